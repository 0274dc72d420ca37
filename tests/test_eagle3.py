"""EAGLE-3: TTT masks and block attention vs the dense reference, training == drafting semantics, draft
vocabulary mapping, loss alignment/masking, training + resume + fine-tune, bad inputs, drafting with
trees (greedy == plain greedy), and the eval job."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHATML, compose, make_tokenizer, tiny_model, tiny_train_overrides
from draftheads.data_prep.draft_vocab import count_assistant_tokens, select_draft_vocab, vocab_stats
from draftheads.eval.eagle3_drafter import Eagle3Drafter
from draftheads.eval.eagle_drafter import EagleTreeConfig
from draftheads.eval.generate import NoDrafter, generate
from draftheads.heads.eagle3 import Eagle3Config, Eagle3Draft, eagle3_config_for
from draftheads.heads.eagle3_ttt import ttt_attention, ttt_attention_dense, ttt_dense_mask
from draftheads.heads.eagle3_vocab import check_vocab_mapping, vocab_mapping
from draftheads.heads.target import from_model, load_target

AUX = [1, 2, 3]  # the default [2, L//2, L-3] collides on the 4-layer tiny targets


@pytest.fixture(scope="module")
def peaked_target_dir(tmp_path_factory):
    """The tiny Llama with its lm_head scaled by 20: a random target's next-token distribution is nearly flat
    (entropy ~ln V), which leaves a soft-CE loss nothing to learn; scaled, it is peaked (entropy ~2.7 nats)."""
    d = tmp_path_factory.mktemp("tiny-llama-peaked")
    m = tiny_model("llama")
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    m.save_pretrained(d)
    make_tokenizer(CHATML).save_pretrained(d)
    return d


def _draft(tgt, dv=50, seed=0, scale=None, aux=AUX, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    V = tgt.vocab_size
    d = Eagle3Draft(eagle3_config_for(tgt, aux, dv, **kw), tgt)
    d.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:dv],
                init_lm_head_from=tgt.lm_head().weight)
    if scale:
        for p in d.parameters():
            p.data.normal_(0, scale) if p.ndim == 2 else p.data.uniform_(0.5, 1.5)
    return d


# ------------------------------------------------------------------------------------------ TTT attention

def test_ttt_mask_equals_hand_built_reference():
    """T=3, step 2: causal over step 0's keys, then one same-position key per later step."""
    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    m = ttt_dense_mask(causal, 2)[0].int().tolist()
    assert m == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0, 0, 1, 0],
                 [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    # packed rows: documents [0, 0, 1, 1]; step 1 keeps the per-document block and adds the diagonal
    doc = torch.tensor([[0, 0, 1, 1]])
    step0 = torch.ones(4, 4, dtype=torch.bool).tril()[None] & (doc[:, :, None] == doc[:, None, :])
    assert ttt_dense_mask(step0, 1)[0].int().tolist() == [[1, 0, 0, 0, 1, 0, 0, 0],
                                                           [1, 1, 0, 0, 0, 1, 0, 0],
                                                           [0, 0, 1, 0, 0, 0, 1, 0],
                                                           [0, 0, 1, 1, 0, 0, 0, 1]]


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("S,steps", [(1, 3), (5, 1), (7, 4)])
def test_block_attention_equals_dense_reference_values_and_grads(S, steps, blocks, monkeypatch):
    """Also in query row blocks of 2 (what sequences of thousands of tokens get; checkpointed under grad)."""
    if blocks:
        import draftheads.heads.eagle3_ttt as ttt

        monkeypatch.setattr(ttt, "BLOCK_SCORES", 2 * 2 * 4 * S)  # B·nh·S scores per row: 2 rows per block
    g = torch.Generator().manual_seed(S * 10 + steps)
    B, nkv, grp, d = 2, 2, 2, 8
    q = torch.randn(B, nkv * grp, S, d, generator=g, requires_grad=True)
    ks = [torch.randn(B, nkv, S, d, generator=g, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(B, nkv, S, d, generator=g, requires_grad=True) for _ in range(steps)]
    doc = torch.tensor([[0] * S, [0] * (S // 2) + [1] * (S - S // 2)])
    step0 = torch.ones(S, S, dtype=torch.bool).tril()[None] & (doc[:, :, None] == doc[:, None, :])
    a = ttt_attention(q, ks, vs, step0, 0.3)
    b = ttt_attention_dense(q, ks, vs, step0, 0.3)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    w = torch.randn(a.shape, generator=g)
    ga = torch.autograd.grad((a * w).sum(), [q, *ks, *vs])
    gb = torch.autograd.grad((b * w).sum(), [q, *ks, *vs])
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_rollout_in_query_blocks_equals_dense_rollout_with_gradients(monkeypatch):
    """The rollout as long sequences run it (TTT attention in checkpointed row blocks, here of 3 rows) computes the
    dense rollout's outputs and parameter gradients: every block's backward recomputes with the keys of its own
    step, although the rollout has appended later steps' keys by then."""
    import draftheads.heads.eagle3_ttt as ttt

    tgt = from_model(tiny_model("llama", vocab_size=128, seed=2))
    d = _draft(tgt, dv=40, scale=0.3)
    S, k = 11, 3
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, S, 3 * tgt.hidden_size, generator=g)
    tokens = torch.randint(0, 128, (1, S + k - 1), generator=g)
    step0, pos = torch.ones(S, S, dtype=torch.bool).tril()[None], torch.arange(S)[None]
    params = [p for p in d.parameters() if p.requires_grad]
    w = [torch.randn(1, S, tgt.hidden_size, generator=g) for _ in range(k)]

    def run(dense: bool):
        outs = d.rollout(aux, tokens, pos, step0, k, dense=dense)
        return outs, torch.autograd.grad(sum((o * w_).sum() for o, w_ in zip(outs, w)), params, allow_unused=True)

    ref, g_ref = run(dense=True)
    n_heads = d.layers[0].self_attn.config.num_attention_heads
    monkeypatch.setattr(ttt, "BLOCK_SCORES", 3 * n_heads * S)  # 3 query rows per block
    got, g_got = run(dense=False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    for a, b in zip(g_got, g_ref):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()) + 1e-8)


@pytest.mark.parametrize("arch,norm_before_residual", [("llama", False), ("gemma3_text", True), ("gpt_oss", False)])
def test_checkpointed_rollout_steps_equal_the_plain_rollout(arch, norm_before_residual, monkeypatch):
    """Under grad the rollout recomputes each step's pieces around its attention in backward (torch.utils.checkpoint,
    for memory): the objective's loss and stats, the rollout's outputs and every parameter gradient equal those of
    the rollout without it (every intermediate kept, the original computation), and a step keeps fewer bytes for
    backward. Gemma 3: q/k norms, head_dim != H/nh, norm_before_residual; gpt-oss: sinks and an MLP tuple."""
    from functools import partial

    from transformers import AutoModelForCausalLM

    from draftheads.scripts.arch_matrix_table import arch_config
    from draftheads.train.eagle3 import Eagle3Objective

    torch.manual_seed(1)
    tgt = from_model(AutoModelForCausalLM.from_config(arch_config(arch)).eval())
    d = _draft(tgt, dv=40, scale=0.3, norm_before_residual=norm_before_residual)
    g = torch.Generator().manual_seed(0)
    B, T, k = 2, 10, 3
    ids = torch.randint(3, tgt.vocab_size, (B, T), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long),
             "loss_mask": torch.tensor([[0, 0] + [1] * 8, [0, 1, 1, 0, 1, 1, 1, 1, 1, 1]])}
    params = [p for p in d.parameters() if p.requires_grad]

    def run(checkpoint: bool):
        monkeypatch.setattr(d, "rollout", partial(Eagle3Draft.rollout, d, checkpoint=checkpoint))
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, stats = Eagle3Objective(d, tgt, ttt_steps=k, decay=0.8)(batch)
        # allow_unused: the draft runs a Gemma layer's residual path as Llama's (its pre/post-feedforward norms idle)
        return loss, stats, torch.autograd.grad(loss, params, allow_unused=True), sum(saved.values())

    loss_ref, st_ref, g_ref, saved_ref = run(checkpoint=False)
    loss, st, g_got, saved_got = run(checkpoint=True)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    flat = lambda stats: {f"{n}.{i}": float(x) for n, v in stats.items() for i, x in enumerate(v)}  # noqa: E731
    assert flat(st) == pytest.approx(flat(st_ref), rel=1e-6)
    for a, b in zip(g_got, g_ref):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()) + 1e-10)
    assert saved_got < saved_ref
    # the rollout's own outputs, with and without, against random output weights
    aux = torch.randn(1, T - 1, 3 * tgt.hidden_size, generator=g)
    toks = torch.randint(0, tgt.vocab_size, (1, T - 1 + k - 1), generator=g)
    step0, pos = torch.ones(T - 1, T - 1, dtype=torch.bool).tril()[None], torch.arange(T - 1)[None]
    w = [torch.randn(1, T - 1, tgt.hidden_size, generator=g) for _ in range(k)]
    res = []
    for ck in (False, True):
        outs = Eagle3Draft.rollout(d, aux, toks, pos, step0, k, checkpoint=ck)
        res.append((outs, torch.autograd.grad(sum((o * w_).sum() for o, w_ in zip(outs, w)), params,
                                              allow_unused=True)))  # the final norm and lm_head: unused
    for a, b in zip(res[1][0], res[0][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the forward runs the same operations
    for a, b in zip(res[1][1], res[0][1]):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()) + 1e-10)


def test_rollout_equals_dense_rollout_and_drafting_along_a_chain():
    """Training-time test == what the drafter computes: step s at the last prompt position t reads the draft's
    step s-1 output with token x_{t+1+s} at position t+s, attending to the committed prefix and its own chain —
    exactly the chain drafter's depth-s expansion. The dense-mask rollout agrees step by step."""
    for kind in ("llama", "qwen2"):
        tgt = from_model(tiny_model(kind, vocab_size=128, seed=2))
        d = _draft(tgt, dv=40, scale=0.3)
        k, prompt = 4, torch.tensor([5, 9, 2, 33, 7, 81, 12])
        P = len(prompt)
        out = tgt(prompt[None], layers=AUX)
        root = int(out["logits"][0, -1].argmax())
        drafter = Eagle3Drafter(d, EagleTreeConfig(kind="chain", depth=k))
        drafter.begin(prompt, {l: h[0] for l, h in out["hidden"].items()})
        tree = drafter.propose(root, None, None)
        chain = tree.tokens.tolist()  # root, c1..ck
        assert all(bool(d.t2d[c]) for c in chain[1:])  # children are draft-vocab tokens, as target ids
        seq = prompt.tolist() + chain  # x_0 .. x_{P+k}
        S = len(seq) - 1
        aux = torch.zeros(1, S, 3 * tgt.hidden_size)
        aux[0, :P] = torch.cat([out["hidden"][a][0] for a in AUX], -1)  # later positions never reach t = P-1
        tokens = torch.tensor([seq[1:] + [0] * (k - 1)])
        step0 = torch.ones(S, S, dtype=torch.bool).tril()[None]
        pos = torch.arange(S)[None]
        with torch.no_grad():
            outs = d.rollout(aux, tokens, pos, step0, k)
            dense = d.rollout(aux, tokens, pos, step0, k, dense=True)
        for s in range(k):
            scale = float(outs[s].abs().max())  # random weights: activations ~1e2, compare relative to that
            torch.testing.assert_close(outs[s], dense[s], rtol=1e-5, atol=2e-6 * scale)
            torch.testing.assert_close(outs[s][0, P - 1], drafter._h[s], rtol=1e-5, atol=2e-6 * scale)


# ------------------------------------------------------------------------------------------ vocabulary

def test_draft_vocab_selection_and_mapping_round_trip(tmp_path):
    rows = {"input_ids": [[5, 3, 3, 9, 7, 7], [7, 1, 3, 2]], "loss_mask": [[0, 1, 1, 1, 1, 0], [1, 1, 0, 1]]}
    counts = count_assistant_tokens(rows, 12)
    assert counts.tolist() == [0, 1, 1, 2, 0, 0, 0, 2, 0, 1, 0, 0]  # only assistant tokens; 5 and the last 7 masked
    # by count (3, 7: 2 each), then ties by smaller id (1, 2, 9: 1 each), then unseen ids (0, 4, ...) by id
    assert select_draft_vocab(counts, 3).tolist() == [1, 3, 7]
    assert select_draft_vocab(counts, 6).tolist() == [0, 1, 2, 3, 7, 9]
    assert vocab_stats(counts, select_draft_vocab(counts, 3))["coverage"] == pytest.approx(5 / 7)
    # held-out coverage: tokens of another split inside the vocabulary counted from the training split
    held = count_assistant_tokens({"input_ids": [[1, 4, 7, 11]], "loss_mask": [[1, 1, 1, 0]]}, 12)
    st = vocab_stats(counts, select_draft_vocab(counts, 3), held)
    assert st["heldout_coverage"] == pytest.approx(2 / 3) and st["coverage"] == pytest.approx(5 / 7)
    assert "heldout_coverage" not in vocab_stats(counts, select_draft_vocab(counts, 3), np.zeros(12, np.int64))
    ref_st = vocab_stats(counts, select_draft_vocab(counts, 3), None, np.array([4, 1, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0]))
    assert ref_st["reference_tokens"] == 8 and ref_st["reference_coverage"] == pytest.approx(4 / 8)  # ids 1, 3, 7
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        count_assistant_tokens(rows, 8)
    d2t, t2d = vocab_mapping([9, 1, 3, 7], 12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [1, 2, 5, 6] and t2d.nonzero().view(-1).tolist() == [1, 3, 7, 9]
    assert (torch.arange(4) + d2t).tolist() == [1, 3, 7, 9]  # draft id -> target id
    from draftheads.heads.eagle3_vocab import draft_ids_of

    back = draft_ids_of(t2d)  # target id -> draft id, -1 outside
    assert back.tolist() == [-1, 0, -1, 1, -1, -1, -1, 2, -1, 3, -1, -1]
    check_vocab_mapping(d2t, t2d, 4, 12, "ok")
    # through a module and a checkpoint: draft ids map back to the same target ids, lm_head rows follow
    tgt = from_model(tiny_model("llama", vocab_size=128))
    d = _draft(tgt, dv=30)
    ids = d.target_ids()
    assert torch.equal(d.to_target(torch.arange(30)), ids) and bool(d.t2d[ids].all()) and int(d.t2d.sum()) == 30
    assert torch.equal(d.lm_head.weight, tgt.lm_head().weight[ids])  # init: the target's rows, in draft order
    d.save_pretrained(tmp_path / "c", tgt.identity)
    back = Eagle3Draft.from_pretrained(tmp_path / "c", tgt)
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)
    assert torch.equal(back.to_target(torch.tensor([0, 29])), ids[[0, 29]])
    t = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and "embed_tokens.weight" not in t



def test_a_reference_corpus_votes_on_the_draft_vocab(tmp_path, cache_env, monkeypatch):
    """A small training split misses common ids; head.draft_vocab_reference ranks by the mean frequency."""
    from draftheads.data_prep.draft_vocab import count_reference_tokens, ranking_scores

    tok = make_tokenizer()
    V = len(tok)
    ref_file = tmp_path / "ref.jsonl"
    convs = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "the cat sat on the mat"}]},
             {"conversations": [{"from": "human", "value": "the the the"}, {"from": "gpt", "value": "a dog"}]},
             {"conversations": []}]  # empty: skipped by the loader
    ref_file.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    ref = count_reference_tokens(str(ref_file), tok, V)
    want = np.bincount(tok("the cat sat on the mat", add_special_tokens=False)["input_ids"]
                       + tok("a dog", add_special_tokens=False)["input_ids"], minlength=V)
    assert ref.tolist() == want.tolist()  # assistant text only: the user's "the the the" is not counted
    # cached: a second call reads the counts back without loading the corpus; another file state is another key
    assert len(list((cache_env / "vocab_ref").glob("*.json"))) == 1
    import draftheads.data_prep.sources as sources
    with monkeypatch.context() as m:
        m.setattr(sources, "load_conversations", lambda *a, **k: pytest.fail("not cached"))
        again = count_reference_tokens(str(ref_file), tok, V)
    assert again.dtype == np.int64 and again.tolist() == ref.tolist()
    ref_file.write_text(ref_file.read_text() + json.dumps({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "zebra"}]}) + "\n")
    grown = count_reference_tokens(str(ref_file), tok, V)
    assert grown.sum() == ref.sum() + len(tok("zebra", add_special_tokens=False)["input_ids"])
    assert len(list((cache_env / "vocab_ref").glob("*.json"))) == 2
    # training counts: id 1 seen 30 times, id 2 once; the reference's most frequent id wins the second slot over an
    # id the training split saw once, and the training split's own top id keeps its slot
    train = np.zeros(V, np.int64)
    train[[1, 2]] = [30, 1]
    top_ref = int(np.argmax(ref))
    assert top_ref not in (1, 2)
    assert select_draft_vocab(train, 2).tolist() == [1, 2]
    assert select_draft_vocab(ranking_scores(train, ref), 2).tolist() == sorted([1, top_ref])
    assert ranking_scores(train, None) is train
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        count_reference_tokens(str(ref_file), tok, 10)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant text"):
        count_reference_tokens(str(empty), tok, V)
    for bad, why in (("no-such-corpus", "unknown conversation source"), (str(tmp_path / "missing.jsonl"), "not found")):
        with pytest.raises(ValueError, match=f"head.draft_vocab_reference=.*{why}"):
            count_reference_tokens(bad, tok, V)

def test_bad_inputs_give_clear_errors(tmp_path):
    tgt = from_model(tiny_model("llama", vocab_size=128))
    with pytest.raises(ValueError, match=r"layer ids \[4\] are outside the target's depth; valid ids are 0..3"):
        eagle3_config_for(tgt, [1, 2, 4], 50)
    with pytest.raises(ValueError, match=r"layer ids \[-1\] are outside"):
        eagle3_config_for(tgt, [-1, 2, 3], 50)
    with pytest.raises(ValueError, match="repeats a layer"):
        eagle3_config_for(tgt, None, 50)  # default [2, 2, 1] on a 4-layer target
    with pytest.raises(ValueError, match=r"draft_vocab_size=200 is larger than the target's vocabulary \(128\)"):
        eagle3_config_for(tgt, AUX, 200)
    assert eagle3_config_for(tgt, AUX, None).draft_vocab_size == 128  # default min(32000, V)
    with pytest.raises(ValueError, match="cannot be larger than the target's"):
        Eagle3Config(hidden_size=64, vocab_size=128, num_target_layers=4, aux_layers=AUX, draft_vocab_size=129)
    d = _draft(tgt)
    d.save_pretrained(tmp_path / "c", tgt.identity)
    t = load_file(str(tmp_path / "c" / "model.safetensors"))
    for drop in (["d2t"], ["t2d"], ["d2t", "t2d"]):
        bad = tmp_path / f"no-{'-'.join(drop)}"
        shutil.copytree(tmp_path / "c", bad)
        save_file({k: v for k, v in t.items() if k not in drop}, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=rf"has no {' / '.join(drop)}: the draft-vocabulary mapping is part of"):
            Eagle3Draft.from_pretrained(bad, tgt)
    bad = tmp_path / "inconsistent"
    shutil.copytree(tmp_path / "c", bad)
    t2d = t["t2d"].clone()
    t2d[int(torch.nonzero(~t2d)[0])] = True
    t2d[int(torch.nonzero(t["t2d"])[0])] = False
    save_file({**t, "t2d": t2d}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        Eagle3Draft.from_pretrained(bad, tgt)
    with pytest.raises(ValueError, match=r"d2t must be int64 of shape \(50,\)"):
        check_vocab_mapping(t["d2t"][:-1], t["t2d"], 50, 128, "x")
    with pytest.raises(ValueError, match="holds a 'eagle3' head, expected 'eagle'"):
        from draftheads.heads.eagle import EagleDraft

        EagleDraft.from_pretrained(tmp_path / "c", tgt)
    with pytest.raises(ValueError, match="vocab_size is 128 there"):
        Eagle3Draft.from_pretrained(tmp_path / "c", from_model(tiny_model("llama", vocab_size=100)))


# ------------------------------------------------------------------------------------------ loss

def test_loss_alignment_masking_and_out_of_vocab_targets(monkeypatch):
    """The objective's loss equals a per-position reference: step s at t is scored against the target's
    distribution of x_{t+2+s} (its logits at t+1+s) restricted to the draft vocabulary and renormalized,
    where x_{t+2+s} is an assistant token; decay^s weights; top-1 vs the full-vocab argmax (OOV = miss)."""
    from draftheads.train.eagle3 import Eagle3Objective

    tgt = from_model(tiny_model("llama", vocab_size=128, seed=4))
    d = _draft(tgt, dv=20, scale=0.2)
    k = 3
    obj = Eagle3Objective(d, tgt, ttt_steps=k, decay=0.8, loss_checkpoint=False)
    ids = torch.tensor([[3, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], [5, 6, 8, 10, 12, 14, 16, 18, 20, 22, 0, 0]])
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0]])
    att = torch.tensor([[1] * 12, [1] * 10 + [0] * 2])
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": lm}
    with torch.no_grad():
        loss, st = obj(batch)
    T = 12
    assert obj.num_targets(batch).item() == int(lm[:, 2:].sum()) == 14
    # reference, one position at a time, with plain autograd
    hid = tgt(ids, attention_mask=att, layers=[*AUX, 4])
    full = tgt.lm_head()(hid["hidden"][4])  # [B, T, V]
    aux = torch.cat([hid["hidden"][a][:, :T - 1] for a in AUX], -1)
    toks = torch.cat([ids[:, 1:], torch.zeros(2, k - 1, dtype=torch.long)], 1)
    vocab = d.target_ids()
    outs = d.rollout(aux, toks, torch.arange(T - 1)[None].expand(2, -1),
                     torch.ones(T - 1, T - 1, dtype=torch.bool).tril()[None].expand(2, -1, -1), k)
    ref, counts, hits = 0.0, [0] * k, [0] * k
    for s in range(k):
        for b in range(2):
            for t in range(T - 2 - s):
                if not (lm[b, t + 2 + s] and att[b, t + 2 + s]):
                    continue
                counts[s] += 1
                p = torch.softmax(full[b, t + 1 + s, vocab], -1)
                logq = torch.log_softmax(d.logits(outs[s][b, t]), -1)
                ref = ref + 0.8 ** s * -(p * logq).sum()
                hits[s] += int(vocab[logq.argmax()] == full[b, t + 1 + s].argmax())
    assert [int(st[f"top1/s{s}"][1]) for s in range(k)] == counts == [14, 13, 11]
    assert [int(st[f"top1/s{s}"][0]) for s in range(k)] == hits
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    # gradients: the fused soft-CE (and its checkpointed form, what training uses) vs plain autograd
    g_ref = torch.autograd.grad(ref, list(d.parameters()))
    import draftheads.train.losses as losses

    for ck in (False, True):
        if ck:  # also several row chunks in the fused loss and in the loss (5 rows each)
            monkeypatch.setattr(losses, "CE_CHUNK_ELEMENTS", 100)
            monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 100)
        o = Eagle3Objective(d, tgt, ttt_steps=k, decay=0.8, loss_checkpoint=ck)
        g = torch.autograd.grad(o(batch)[0], list(d.parameters()))
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))
    # a small draft vocab leaves most target argmaxes outside it: counted, and never a hit
    oov = sum(int(not d.t2d[full[b, t + 1].argmax()]) for b in range(2) for t in range(T - 2)
              if lm[b, t + 2] and att[b, t + 2])
    assert st["oov_argmax"][0].item() == oov > 0 and 0 < st["vocab_mass"][0].item() / 14 < 1
    # the whole vocabulary as draft vocabulary: nothing is out of it
    with torch.no_grad():
        _, st = Eagle3Objective(_draft(tgt, dv=128), tgt, ttt_steps=2)(batch)
    assert st["oov_argmax"][0].item() == 0 and st["vocab_mass"][0].item() == pytest.approx(14)


# ------------------------------------------------------------------------------------------ training

def _rows(out_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _kw(**extra):
    return {"head.aux_layers": "[1,2,3]", "head.draft_vocab_size": 100, "head.ttt_steps": 3, "optim.lr": 3e-3,
            "train.log_every": 1, **extra}


def test_training_lowers_loss_resumes_exactly_and_fine_tunes_keep_the_vocab(tmp_path, peaked_target_dir, chat_file):
    from draftheads.train.eagle3 import main

    tiny_target_dir = peaked_target_dir

    kw = _kw(**{"train.max_steps": 24, "train.save_every": 12, "train.keep_last": 5})
    summary = main(compose("eagle3", tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "full", **kw)))
    rows = _rows(tmp_path / "full")
    mean = lambda key, steps: sum(rows[s][key] for s in steps) / len(steps)  # noqa: E731
    first, last = (1, 2, 3), (22, 23, 24)
    # the soft-CE floor is the target's entropy (~2.7 nats per step, ×(1 + .8 + .64)); the KL part shrinks
    assert mean("loss", last) < 0.5 * mean("loss", first), {s: r["loss"] for s, r in rows.items()}
    for s in range(3):
        assert mean(f"ce/s{s}", last) < 0.6 * mean(f"ce/s{s}", first)
    assert mean("top1/s0", first) < 0.01 < mean("top1/s0", range(15, 25))
    assert {f"top1/s{s}" for s in range(3)} | {"ce/s0", "oov_argmax", "vocab_mass"} <= set(rows[24])
    assert summary["draft_vocab"]["source"] == "counted" and summary["draft_vocab"]["coverage"] == 1.0
    assert 0.0 < summary["draft_vocab"]["heldout_coverage"] <= 1.0
    final = tmp_path / "full" / "final"
    ck = json.loads((final / "config.json").read_text())
    assert ck["family"] == "eagle3" and ck["ttt_steps"] == 3 and ck["head_config"]["aux_layers"] == AUX
    assert "heldout_top1_s0" in ck["heldout"]
    tensors = load_file(str(final / "model.safetensors"))
    # the vocabulary is the 100 most frequent assistant ids of the training split
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    from draftheads.data_prep.dataset import prepare_data

    data = prepare_data(compose("eagle3", tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "full",
                                                                 **kw)).data, tgt.tokenizer)
    vocab = select_draft_vocab(count_assistant_tokens(data.train, tgt.vocab_size), 100)
    assert (torch.arange(100) + tensors["d2t"]).tolist() == vocab.tolist()
    # killed after step 18: step-12 is the last checkpoint; resume reproduces steps 13..24
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "full", killed)
    shutil.rmtree(killed / "checkpoints" / "step-000024")
    shutil.rmtree(killed / "final")
    s2 = main(compose("eagle3", tiny_train_overrides(tiny_target_dir, chat_file, killed,
                                                     **kw, **{"train.resume": "true"})))
    assert s2["draft_vocab"]["source"].startswith("resume:")
    assert s2["draft_vocab"]["heldout_coverage"] == summary["draft_vocab"]["heldout_coverage"]  # carried over
    assert s2["draft_vocab"]["distinct_assistant_ids"] == summary["draft_vocab"]["distinct_assistant_ids"]
    got = _rows(killed)
    assert sorted(got) == list(range(1, 25))
    for s in range(13, 25):
        assert got[s]["loss"] == pytest.approx(rows[s]["loss"], rel=1e-6, abs=1e-7), s
    # fine-tuning from the checkpoint on other data keeps its d2t/t2d (never recounted)
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"id": f"o{i}", "conversations": [
        {"from": "human", "value": f"say hello {i}"}, {"from": "gpt", "value": "hello there " * (i % 5 + 1)}]})
        for i in range(40)) + "\n")
    ft = main(compose("eagle3", tiny_train_overrides(
        tiny_target_dir, other, tmp_path / "ft", **_kw(**{"train.max_steps": 2, "head.init_from": str(final),
                                                          "head.draft_vocab_size": "null"}))))
    assert ft["draft_vocab"]["source"] == f"init_from:{final}"
    assert torch.equal(load_file(str(tmp_path / "ft" / "final" / "model.safetensors"))["d2t"], tensors["d2t"])
    with pytest.raises(ValueError, match=r"head.draft_vocab_size=50 but the checkpoint .* has 100"):
        main(compose("eagle3", tiny_train_overrides(
            tiny_target_dir, other, tmp_path / "ft2", **_kw(**{"head.init_from": str(final),
                                                                "head.draft_vocab_size": 50}))))


def test_frozen_lm_head_keeps_the_target_rows_and_trains_the_rest(tmp_path, peaked_target_dir, chat_file):
    from draftheads.train.eagle3 import main

    kw = _kw(**{"train.max_steps": 12, "head.freeze_lm_head": "true"})
    summary = main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "frz", **kw)))
    rows = _rows(tmp_path / "frz")
    assert sum(rows[s]["loss"] for s in (10, 11, 12)) < 0.8 * sum(rows[s]["loss"] for s in (1, 2, 3))
    tensors = load_file(str(tmp_path / "frz" / "final" / "model.safetensors"))
    tgt = load_target({"name": str(peaked_target_dir), "dtype": "fp32"})
    ids = torch.arange(100) + tensors["d2t"]  # draft id -> target id
    assert torch.equal(tensors["lm_head.weight"], tgt.lm_head().weight.detach()[ids].float())
    H = tgt.hidden_size
    assert summary["trainable_params"] == sum(v.numel() for k, v in tensors.items()
                                              if k not in ("d2t", "t2d", "aux_scale")) - 100 * H
    assert json.loads((tmp_path / "frz" / "final" / "config.json").read_text())["freeze_lm_head"] is True
    # the fc and the layer did train
    init = tmp_path / "init"
    main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, init,
                                                **_kw(**{"train.max_steps": 0, "head.freeze_lm_head": "true"}))))
    assert not torch.equal(load_file(str(init / "final" / "model.safetensors"))["fc.weight"], tensors["fc.weight"])
    with pytest.raises(ValueError, match="head.freeze_lm_head=true .* needs head.init_lm_head=target"):
        main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "x",
                                                    **_kw(**{"head.freeze_lm_head": "true",
                                                             "head.init_lm_head": "random"}))))



def test_trainer_ranks_the_vocab_with_a_reference_corpus_and_records_it(tmp_path, peaked_target_dir, chat_file):
    from draftheads.data_prep.dataset import prepare_data
    from draftheads.data_prep.draft_vocab import count_reference_tokens, ranking_scores
    from draftheads.train.eagle3 import main

    ref = tmp_path / "ref.jsonl"
    ref.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"},
                                                            {"from": "gpt", "value": "zebra quartz jukebox " * 5}]})
                             for i in range(4)) + "\n")
    cfg = compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "ref-run", **_kw(**{
        "train.max_steps": 0, "head.draft_vocab_reference": str(ref)})))
    summary = main(cfg)
    info = summary["draft_vocab"]
    assert info["reference"] == str(ref) and info["reference_tokens"] > 0 and 0 < info["reference_coverage"] <= 1
    tgt = load_target({"name": str(peaked_target_dir), "dtype": "fp32"})
    train = count_assistant_tokens(prepare_data(cfg.data, tgt.tokenizer).train, tgt.vocab_size)
    want = select_draft_vocab(ranking_scores(train, count_reference_tokens(str(ref), tgt.tokenizer,
                                                                           tgt.vocab_size)), 100)
    assert not np.array_equal(want, select_draft_vocab(train, 100))  # the reference changed the ranking
    d2t = load_file(str(tmp_path / "ref-run" / "final" / "model.safetensors"))["d2t"]
    assert (torch.arange(100) + d2t).tolist() == want.tolist()
    saved = json.loads((tmp_path / "ref-run" / "final" / "config.json").read_text())["draft_vocab"]
    assert saved["reference"] == str(ref)

# ------------------------------------------------------------------------------------------ drafting

TREES = [EagleTreeConfig(top_k=4, depth=5, nodes=20), EagleTreeConfig(kind="chain", depth=4),
         EagleTreeConfig(kind="static", paths=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])]


def test_greedy_speculative_equals_plain_greedy_and_drafts_stay_in_the_draft_vocab():
    for kind in ("llama", "qwen2"):
        tgt = from_model(tiny_model(kind, vocab_size=128, seed=3))
        d = _draft(tgt, dv=60, scale=0.3)
        vocab = set(d.target_ids().tolist())
        for tc in TREES:
            drafter = Eagle3Drafter(d, tc)
            proposed = []
            real = drafter.propose
            drafter.propose = lambda *a, _r=real: proposed.append(_r(*a)) or proposed[-1]
            for prompt in ([1, 2, 3, 4, 5], list(range(10, 40))):
                ref = generate(tgt, NoDrafter(), prompt, 24).tokens
                res = generate(tgt, drafter, prompt, 24)
                assert res.tokens == ref, (kind, tc, prompt)
            assert all(set(t.tokens[1:].tolist()) <= vocab for t in proposed)
            assert max(t.tokens.numel() for t in proposed) == (21 if tc.kind == "dynamic" else drafter.static.size)
        # sampling: deterministic top-k children verified by the exact multi-candidate rule
        res = generate(tgt, Eagle3Drafter(d, TREES[0]), [1, 2, 3], 16, mode="exact", sampling={"temperature": 1.0},
                       generator=torch.Generator().manual_seed(0))
        assert len(res.tokens) == 16
        # a bf16 drafter (what eval uses with a bf16 target) only changes the guesses: the fp32 target decides
        ref = generate(tgt, NoDrafter(), list(range(10, 40)), 24).tokens
        bf16 = Eagle3Drafter(copy.deepcopy(d), TREES[0], torch.bfloat16)
        assert bf16.draft.lm_head.weight.dtype == torch.bfloat16 and bf16.draft.d2t.dtype == torch.int64
        assert generate(tgt, bf16, list(range(10, 40)), 24).tokens == ref


def test_eval_job_with_an_eagle3_checkpoint(tmp_path, tiny_target_dir):
    from draftheads.eval.acceptance import main as eval_main
    from draftheads.eval.drafters import build_drafter

    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    _draft(tgt, dv=100).save_pretrained(tmp_path / "d", tgt.identity)
    drafter, desc = build_drafter("auto", tgt, str(tmp_path / "d"), compose("eval", []).tree, tgt.dtype)
    assert isinstance(drafter, Eagle3Drafter) and drafter.layers == tuple(AUX)
    assert desc["drafter"] == "eagle3" and desc["tree_kind"] == "dynamic" and desc["draft_vocab_size"] == 100
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["count from one"]}) + "\n")
    res = eval_main(compose("eval", [
        "target=hf", f"target.name={tiny_target_dir}", "target.dtype=fp32", "target.local_files_only=true",
        f"checkpoint={tmp_path / 'd'}", f"questions={qfile}", "max_new_tokens=16", "compare_plain=true",
        f"out={tmp_path / 'eval.json'}", "tree.top_k=4", "tree.nodes=12",
        "tree.select=default"]))  # depth 6 (the family default); tree=auto is tested in tests/test_autotree.py
    assert res["drafter"]["drafter"] == "eagle3" and res["drafter"]["tree_size"] == 13
    assert res["greedy_identical"]["identical"] == res["greedy_identical"]["turns"] == 1


def test_offline_features_train_exactly_like_online(tmp_path, peaked_target_dir, chat_file):
    """The aux layers + L captured once (fp32) give the same loss curve as the target running in the job."""
    from draftheads.data_prep.features import main as capture
    from draftheads.train.eagle3 import main

    common = ["target=hf", f"target.name={peaked_target_dir}", "target.dtype=fp32", "target.local_files_only=true",
              "data=file", f"data.path={chat_file}", "data.max_length=64", "data.heldout_fraction=0.1",
              f"data.cache_dir={tmp_path / 'data-cache'}"]
    capture(compose("features", common + ["layers=[1,2,3,-1]", "dtype=fp32", f"out={tmp_path / 'feat'}",
                                          "rows_per_shard=64", "batch_size=16", "device=cpu"]))
    kw = _kw(**{"train.max_steps": 4, "data.cache_dir": str(tmp_path / "data-cache")})
    on = main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "on", **kw)))
    off = main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "off", **kw,
                                                      **{"features.dir": str(tmp_path / "feat")})))
    assert off["features"].startswith("offline:") and on["features"] == "online"
    assert off["losses"] == pytest.approx(on["losses"], rel=1e-5) and len(on["losses"]) == 4
    with pytest.raises(ValueError, match=r"field layers is \[1, 2, 3, 4\], this run needs \[0, 2, 3, 4\]"):
        main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "x",
                                                    **{**kw, "head.aux_layers": "[0,2,3]",
                                                       "features.dir": str(tmp_path / "feat")})))


def test_acceptance_ranks_for_the_simulated_tau(peaked_target_dir):
    """On the target's own greedy continuation every window of k+1 assistant tokens is scored, and the rank at
    depth d is the reference token's rank among TTT step d-1's top-k (draft ids; out-of-vocab = top_k)."""
    from draftheads.train.eagle3 import Eagle3Objective

    tgt = load_target({"name": str(peaked_target_dir), "dtype": "fp32"})
    d = _draft(tgt, dv=200, scale=0.05)
    k, P = 3, 12
    prompt = list(range(30, 30 + P))
    gen = generate(tgt, NoDrafter(), prompt, 20).tokens
    ids = torch.tensor([prompt + gen])
    T = ids.shape[1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.tensor([[0] * P + [1] * len(gen)])}
    obj = Eagle3Objective(d, tgt, ttt_steps=k)
    ranks, considered = obj.acceptance_ranks(batch, top_k=5)
    assert considered == len(gen) and ranks.shape == (len(gen) - k, k)  # windows start at t = P-1 .. T-k-2
    hid = tgt(ids, layers=AUX, logits=False)["hidden"]
    with torch.no_grad():
        outs = d.rollout(torch.cat([hid[a][:, :T - 1] for a in AUX], -1),
                         torch.cat([ids[:, 1:], torch.zeros(1, k - 1, dtype=torch.long)], 1),
                         torch.arange(T - 1)[None], torch.ones(T - 1, T - 1, dtype=torch.bool).tril()[None], k)
    vocab = d.target_ids().tolist()
    for row, t in enumerate(range(P - 1, T - k - 1)):
        for s in range(k):
            top = d.to_target(d.logits(outs[s][0, t]).topk(5).indices).tolist()
            ref = int(ids[0, t + 2 + s])
            assert int(ranks[row, s]) == (top.index(ref) if ref in top else 5)
            if ref not in vocab:
                assert int(ranks[row, s]) == 5


def test_rollout_eval_script_scores_a_checkpoint_like_the_trainer(tmp_path, peaked_target_dir, chat_file):
    """scripts/eagle3_rollout_eval.py: a ttt_steps=1 draft scored with a 3-step rollout; its step-0 metrics equal the
    trainer's own final held-out evaluation (same rows, same objective), and the later steps are reported too."""
    import importlib.util

    from draftheads.train.eagle3 import main

    kw = _kw(**{"head.ttt_steps": 1})
    ov = tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "run", **kw)
    main(compose("eagle3", ov))
    final = tmp_path / "run" / "final"
    stored = json.loads((final / "config.json").read_text())["heldout"]
    spec = importlib.util.spec_from_file_location(
        "rollout_eval", Path(__file__).resolve().parents[1] / "scripts" / "eagle3_rollout_eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    keep = [o for o in ov if not o.startswith(("out_dir=", "head."))]
    res = mod.evaluate(str(final), 3, keep)
    m = res["metrics"]
    assert {f"heldout_top1_s{s}" for s in range(3)} <= set(m) and "sim_tau/positions" in m
    assert abs(m["heldout_top1_s0"] - stored["heldout_top1_s0"]) < 1e-4
    assert abs(m["heldout_ce_s0"] - stored["heldout_ce_s0"]) < 1e-3
    with pytest.raises(ValueError, match="not a head checkpoint"):
        mod.evaluate(str(tmp_path), 3, keep)


def test_measure_counts_emitted_tokens_outside_the_draft_vocab():
    """eval.measure: each EAGLE-3 row counts the emitted tokens its draft vocabulary cannot propose (a hard cap on
    acceptance); the aggregate is their share of new tokens; full-vocabulary drafters report None."""
    from draftheads.eval.measure_run import out_of_draft_vocab
    from draftheads.eval.measure_summary import aggregate

    tgt = from_model(tiny_model("llama", vocab_size=128, seed=3))
    d = _draft(tgt, dv=60)
    vocab = set(d.target_ids().tolist())
    inside, outside = sorted(vocab)[:3], sorted(set(range(128)) - vocab)[:2]
    drafter = Eagle3Drafter(d, TREES[0])
    assert out_of_draft_vocab(drafter, inside + outside + outside[:1]) == 3
    assert out_of_draft_vocab(drafter, inside) == 0 and out_of_draft_vocab(NoDrafter(), outside) is None
    res = generate(tgt, drafter, list(range(10, 40)), 24)
    n = out_of_draft_vocab(drafter, res.tokens)
    assert n == sum(t not in vocab for t in res.tokens)
    # every emitted out-of-vocab token was a rejection: accepted draft tokens all lie inside the vocabulary
    assert sum(res.accepted) <= len(res.tokens) - n
    row = {"steps": 4, "accepted_total": 4, "new_tokens": 8, "seconds": 1.0, "prefill_seconds": 0.1,
           "target_seconds": 0.5, "draft_seconds": 0.2, "tree_sizes_mean": 5.0}
    agg = aggregate([{**row, "out_of_draft_vocab": 2}, {**row, "out_of_draft_vocab": 0}, {**row}])
    assert agg["draft_vocab_oov"] == pytest.approx(2 / 16)
    assert "draft_vocab_oov" not in aggregate([row])


def test_vocab_coverage_script_tables_sizes_with_and_without_a_reference(tmp_path, peaked_target_dir, chat_file):
    from draftheads.scripts.vocab_coverage import main as coverage

    ref = tmp_path / "ref.jsonl"
    ref.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"},
                                                 {"from": "gpt", "value": "zebra quartz jukebox " * 5}]}) + "\n")
    over = ["target=hf", f"target.name={peaked_target_dir}", "target.local_files_only=true", "data=file",
            f"data.path={chat_file}", "data.heldout_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}"]
    res = coverage(["sizes=[10,100,400]", f"reference={ref}", f"out={tmp_path / 'cov.json'}", *over])
    assert json.loads((tmp_path / "cov.json").read_text()) == res
    rows = res["rows"]
    assert [r["draft_vocab_size"] for r in rows] == [10, 10, 100, 100, res["target_vocab"], res["target_vocab"]]
    assert [r["ranked_by"] for r in rows[:2]] == ["training split", f"training split + {ref}"]
    own = [r for r in rows if r["ranked_by"] == "training split"]
    assert own[0]["heldout_coverage"] < own[1]["heldout_coverage"] <= own[2]["heldout_coverage"] == 1.0
    assert own[2]["coverage"] == 1.0 and res["reference_tokens"] > 0
    assert res["distinct_train_ids"] < 100  # synthetic chats: 100 ids cover the training split
    assert rows[1]["reference_coverage"] >= rows[0]["reference_coverage"]  # the reference voted for its own ids
    with pytest.raises(ValueError, match="sizes must be a list"):
        coverage(["sizes=8192", *over])


def test_a_fresh_draft_reads_unit_rms_feature_channels(tmp_path, peaked_target_dir, chat_file):
    """head.aux_scale=true: a fresh draft's saved scale makes every aux-feature channel unit-RMS over the rows
    it was estimated on (the first training rows' labelled positions), checked with direct one-row target forwards;
    a resumed run keeps the checkpoint's scale; head.aux_scale=false builds no scale."""
    from draftheads.data_prep.dataset import prepare_data
    from draftheads.train.eagle3 import main

    cfg = compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "s",
                                                  **_kw(**{"train.max_steps": 2, "train.save_every": 2,
                                                           "head.aux_scale": "true"})))
    main(cfg)
    ck = json.loads((tmp_path / "s" / "final" / "config.json").read_text())
    assert ck["head_config"]["aux_scale"] is True
    scale = load_file(str(tmp_path / "s" / "final" / "model.safetensors"))["aux_scale"]  # [3H]
    tgt = load_target({"name": str(peaked_target_dir), "dtype": "fp32"})
    rows = prepare_data(cfg.data, tgt.tokenizer).train
    sq, n, i = torch.zeros(scale.numel(), dtype=torch.float64), 0, 0
    while n < 16384 and i < len(rows):  # feature_rms's budget, in its batches of 4 rows
        for r in [rows[j] for j in range(i, min(i + 4, len(rows)))]:
            ids = torch.tensor(r["input_ids"])[None]
            hid = tgt(ids, layers=AUX, logits=False)["hidden"]
            keep = torch.tensor(r["loss_mask"][2:]).bool()  # position t is labelled when x_{t+2} is
            x = torch.cat([hid[a][0, : keep.numel()][keep] for a in AUX], -1).double()
            sq += x.pow(2).sum(0)
            n += x.shape[0]
        i += 4
    assert ck["aux_scale"]["tokens"] == n > 1000 and ck["aux_scale"]["applied"] is True
    rms = (sq / n).sqrt().float() * scale  # the scaled channels' RMS
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)
    assert float(scale.max() / scale.min()) > 1.5  # the raw channels' RMS differ: a real rescaling, not ones
    # resume keeps the checkpoint's scale (never re-estimated), off builds none
    s2 = main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "s",
                                                      **_kw(**{"train.max_steps": 3, "train.resume": "true",
                                                               "head.aux_scale": "true"}))))
    assert s2["draft_vocab"]["source"].startswith("resume:")
    assert json.loads((tmp_path / "s" / "final" / "config.json").read_text())["aux_scale"] == "checkpoint"
    assert torch.equal(load_file(str(tmp_path / "s" / "final" / "model.safetensors"))["aux_scale"], scale)
    main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "off",
                                                **_kw(**{"train.max_steps": 1, "head.aux_scale": "false"}))))
    assert "aux_scale" not in load_file(str(tmp_path / "off" / "final" / "model.safetensors"))
    assert json.loads((tmp_path / "off" / "final" / "config.json").read_text())["head_config"]["aux_scale"] is False
    # auto (the default) applies it only where the largest channel's RMS reaches 300x the median's: not on this
    # tiny target, whose scale stays at ones (raw features, the numbers of a draft without it)
    main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "auto",
                                                **_kw(**{"train.max_steps": 1}))))
    auto = json.loads((tmp_path / "auto" / "final" / "config.json").read_text())["aux_scale"]
    assert auto["mode"] == "auto" and auto["applied"] is False
    ratio = float((1 / scale).max() / (1 / scale).median())
    assert auto["max_over_median_rms"] == pytest.approx(ratio, abs=0.006) and ratio < 300
    assert torch.equal(load_file(str(tmp_path / "auto" / "final" / "model.safetensors"))["aux_scale"],
                       torch.ones_like(scale))
    with pytest.raises(ValueError, match=r"head.aux_scale='on': allowed values are true, false and auto"):
        main(compose("eagle3", tiny_train_overrides(peaked_target_dir, chat_file, tmp_path / "bad",
                                                    **_kw(**{"head.aux_scale": "on"}))))
