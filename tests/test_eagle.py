"""EAGLE draft: target-family layer, loss alignment, training + checkpoints + resume, drafting with
static and EAGLE-2 dynamic trees (greedy == plain greedy), tree masks/positions, KV rollback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import assert_tau_accounts_for_tokens, compose, tiny_model, tiny_train_overrides
from draftheads.eval.eagle_drafter import EagleDrafter, EagleTreeConfig
from draftheads.eval.generate import NoDrafter, generate
from draftheads.eval.trees import ancestor_mask, dynamic_tree, tree_inputs
from draftheads.heads.eagle import EagleDraft, eagle_config_for
from draftheads.heads.target import from_model, load_target


def _draft(tgt, seed=0, **kw) -> EagleDraft:
    torch.manual_seed(seed)
    return EagleDraft(eagle_config_for(tgt, **kw), tgt)


# ------------------------------------------------------------------------------------------ module

def test_draft_is_one_layer_of_the_target_family_without_target_weights():
    for kind, cls in (("llama", "LlamaDecoderLayer"), ("qwen2", "Qwen2DecoderLayer")):
        tgt = from_model(tiny_model(kind))
        d = _draft(tgt)
        assert type(d.layer).__name__ == cls and type(d.layer) is type(tgt.decoder_layers()[0])
        target_layer = {k: v.shape for k, v in tgt.decoder_layers()[0].state_dict().items()}
        assert {k[len("layer."):]: v.shape for k, v in d.state_dict().items() if k.startswith("layer.")} == target_layer
        assert set(k for k in d.state_dict() if not k.startswith("layer.")) == {"fc.weight", "fc.bias"}
        assert d.fc.weight.shape == (64, 128)
        H, V = 64, 400
        n_layer = sum(v.numel() for v in tgt.decoder_layers()[0].state_dict().values())
        assert sum(p.numel() for p in d.parameters()) == 2 * H * H + H + n_layer  # no embedding, no lm_head (V·H)
        assert d.config.resolved_layer == 4 and not d.config.needs_final_norm
        x = d(torch.randn(2, 5, H), torch.randint(0, V, (2, 5)), torch.arange(5)[None].expand(2, 5),
              torch.ones(5, 5, dtype=torch.bool).tril()[None].expand(2, 5, 5))
        assert x.shape == (2, 5, H) and d.logits(x).shape == (2, 5, V)


def test_loss_alignment_is_pinned():
    """Position t reads (f_t, x_{t+1}), is scored against f_{t+1} and the target's p(x_{t+2}), where x_{t+2}
    is an assistant token. A draft that outputs exactly f_{t+1} has zero feature loss and agrees with the
    target's greedy token everywhere; one shifted by a position does not."""
    from draftheads.train.eagle import EagleObjective

    tgt = from_model(tiny_model("llama", vocab_size=128))
    obj = EagleObjective(_draft(tgt), tgt, noise="none")
    ids = torch.tensor([[3, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    f = tgt(ids, logits=False)["last_hidden"]  # [1, T, H]
    seen = {}

    def oracle(features, next_ids, position_ids, allowed, cache=None, shift=1):
        seen.update(features=features, next_ids=next_ids, pos=position_ids, allowed=allowed)
        S = features.shape[1]
        return f[:, shift:shift + S] if shift else features

    obj.draft.forward = oracle
    loss, st = obj(batch)
    n = int(loss_mask[0, 2:].sum())  # labels x_{t+2}
    assert obj.num_targets(batch).item() == n == 7
    torch.testing.assert_close(seen["features"], f[:, :-1].float())  # f_t, t = 0..T-2
    assert torch.equal(seen["next_ids"], ids[:, 1:])  # x_{t+1}
    assert seen["pos"].tolist() == [list(range(11))]
    assert torch.equal(seen["allowed"][0], torch.ones(11, 11, dtype=torch.bool).tril())
    assert st["feat"][0].item() == 0 and st["feat"][1].item() == n
    assert st["top1/target"][0].item() == n
    # the CE target is the target's own distribution of x_{t+2}: CE equals its entropy when the draft matches it
    p = torch.softmax(tgt(ids)["logits"][0, 1:-1].float(), -1)[loss_mask[0, 2:].bool()]
    entropy = -(p * p.log()).sum()
    assert st["ce"][0].item() == pytest.approx(entropy.item(), rel=1e-4)
    assert loss.item() == pytest.approx(0.1 * entropy.item(), rel=1e-4)
    obj.draft.forward = lambda *a, **k: oracle(*a, **k, shift=0)  # off by one: predicts f_t instead of f_{t+1}
    _, st = obj(batch)
    assert st["feat"][0].item() > 0.01 * n and st["top1/target"][0].item() < n


def test_checkpoint_for_another_target_is_refused(tmp_path, tiny_target_dir, tiny_qwen2_dir):
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    d = _draft(tgt)
    d.save_pretrained(tmp_path / "d", tgt.identity)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["family"] == "eagle" and cfg["target"]["fingerprint"] == tgt.identity.fingerprint
    assert cfg["head_config"]["layer_config"]["num_key_value_heads"] == 2
    from safetensors.torch import load_file

    assert not any("embed" in k or "lm_head" in k for k in load_file(str(tmp_path / "d" / "model.safetensors")))
    back = EagleDraft.from_pretrained(tmp_path / "d", tgt)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    qwen = load_target({"name": str(tiny_qwen2_dir), "dtype": "fp32"})
    with pytest.raises(ValueError, match=r"EAGLE checkpoint .*config.json was made for target .*fingerprint"):
        EagleDraft.from_pretrained(tmp_path / "d", qwen)
    with pytest.raises(ValueError, match=r"field layer_config.model_type is 'llama' there but 'qwen2'"):
        EagleDraft.from_pretrained(tmp_path / "d", qwen, allow_target_mismatch=True)
    with pytest.raises(ValueError, match="vocab_size is 400 there"):
        EagleDraft.from_pretrained(tmp_path / "d", from_model(tiny_model("llama", vocab_size=300)))
    with pytest.raises(ValueError, match="holds a 'eagle' head, expected 'medusa'"):
        from draftheads.heads.medusa import MedusaHeads

        MedusaHeads.from_pretrained(tmp_path / "d", tgt)


# ------------------------------------------------------------------------------------------ training

def _losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_training_lowers_loss_and_resumes_exactly(tmp_path, tiny_target_dir, chat_file):
    from draftheads.train.eagle import main

    kw = {"train.max_steps": 24, "train.save_every": 12, "train.keep_last": 5, "optim.lr": 3e-3,
          "train.log_every": 1}
    summary = main(compose("eagle", tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "full", **kw)))
    ref = _losses(tmp_path / "full")
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
    mean = lambda k, steps: sum(rows[s][k] for s in steps) / len(steps)  # noqa: E731
    # the random target's next-token distribution is nearly flat, so CE sits near its entropy (~ln 400) and the
    # feature loss carries the learning signal
    assert mean("loss", (22, 23, 24)) < mean("loss", (1, 2, 3)) - 0.2, ref
    assert mean("feat", (22, 23, 24)) < 0.5 * mean("feat", (1, 2, 3))
    assert mean("ce", (22, 23, 24)) < mean("ce", (1, 2, 3))
    assert rows[1]["top1/target"] < 0.05 and mean("top1/target", (22, 23, 24)) > 0.2
    assert summary["features"] == "online"
    ckpt = json.loads((tmp_path / "full" / "final" / "config.json").read_text())
    assert ckpt["family"] == "eagle" and ckpt["heldout"]["heldout_top1"] > 0.2 and ckpt["features"] == "online"
    # the final evaluation logs the held-out metrics and the simulated τ (these chats are not the random target's
    # greedy path, so few or no positions are scored)
    final_eval = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final_eval["step"] == 24 and "loss" not in final_eval
    assert {"heldout_feat", "heldout_ce", "heldout_top1", "sim_tau/positions"} <= set(final_eval)
    assert set(final_eval) <= set(summary["last"])
    # summary.json carries the loop's scale-out fields, like every family's
    from safetensors.torch import load_file

    assert json.loads((tmp_path / "full" / "summary.json").read_text()) == summary
    assert summary["family"] == "eagle" and summary["steps"] == 24 and len(summary["losses"]) == 24
    assert summary["launch"]["mode"] == "single" and summary["launch"]["num_processes"] == 1
    assert summary["trainable_params"] == sum(v.numel() for v in load_file(
        str(tmp_path / "full" / "final" / "model.safetensors")).values())
    assert summary["steps_per_s"] > 0 and summary["eval"] is None and summary["resumed_from_step"] == 0
    assert len(summary["peak_rss_mb_per_rank"]) == len(summary["peak_rss_loop_mb_per_rank"]) == 1
    assert summary["peak_rss_loop_mb"] == summary["peak_rss_loop_mb_per_rank"][0] > 0
    # killed after step 18: step-12 is the last complete checkpoint; noise RNG and data order must line up
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "full", killed)
    shutil.rmtree(killed / "checkpoints" / "step-000024")
    shutil.rmtree(killed / "final")
    resumed = main(compose("eagle", tiny_train_overrides(tiny_target_dir, chat_file, killed, **kw,
                                                         **{"train.resume": "true"})))
    assert resumed["resumed_from_step"] == 12 and len(resumed["losses"]) == 12  # seconds and losses: this process's
    got = _losses(killed)
    assert sorted(got) == list(range(1, 25))
    for s in range(13, 25):
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), (s, got[s], ref[s])


# ------------------------------------------------------------------------------------------ trees

def test_dynamic_tree_on_a_toy_table():
    """top_k=2, depth=3, nodes=5: expand the 2 best per depth by cumulative log-prob, keep the 5 best overall."""
    lp = {(): [("a", -0.1), ("b", -1.0)],
          ("a",): [("c", -0.2), ("d", -2.0)], ("b",): [("e", -0.05), ("f", -3.0)],
          ("a", "c"): [("g", -0.1), ("h", -0.5)], ("b", "e"): [("i", -0.01), ("j", -4.0)],
          ("a", "d"): [("x", -0.1), ("y", -0.1)]}
    names = {n: i + 10 for i, n in enumerate("abcdefghijxy")}
    calls = []

    def children(frontier, tokens, parents, depths):
        rows = []
        for c in frontier:
            path = []
            while c > 0:
                path.append(next(k for k, v in names.items() if v == tokens[c]))
                c = parents[c]
            rows.append(lp[tuple(reversed(path))])
        calls.append([[n for n, _ in r] for r in rows])
        return torch.tensor([[names[n] for n, _ in r] for r in rows]), torch.tensor([[v for _, v in r] for r in rows])

    t = dynamic_tree(names["r"] if "r" in names else 1, children, top_k=2, depth=3, nodes=5)
    # depth 2 expands a (-0.1) and b (-1.0); depth 3 expands the best two of {c -0.3, d -2.1, e -1.05, f -4.0}
    assert calls == [[["a", "b"]], [["c", "d"], ["e", "f"]], [["g", "h"], ["i", "j"]]]
    inv = {v: k for k, v in names.items()}
    # scores: a -.1, c -.3, g -.4, h -.8, b -1, e -1.05, i -1.06, d -2.1 ...: the best 5 are a c g h b
    assert [inv.get(int(x), "root") for x in t.tokens] == ["root", "a", "b", "c", "g", "h"]
    assert t.parents.tolist() == [-1, 0, 0, 1, 3, 3]
    assert t.depths.tolist() == [0, 1, 1, 2, 3, 3]
    assert t.scores.tolist() == pytest.approx([0, -0.1, -1.0, -0.3, -0.4, -0.8])
    # budget larger than the candidates: everything, still a valid tree (parents first)
    calls.clear()
    big = dynamic_tree(1, children, top_k=2, depth=2, nodes=100)
    assert big.tokens.numel() == 1 + 2 + 4 and all(p < i for i, p in enumerate(big.parents.tolist()))


def test_tree_mask_and_positions_on_a_hand_built_tree():
    """Tree root → {1 → {3 → 6, 4}, 2 → 5} on a 3-token prefix: node i attends to the prefix, its ancestors
    and itself, at position prefix + depth, and its logits equal a plain forward of prefix + its path."""
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    mask, pos = tree_inputs(parents, 3)
    assert pos.tolist() == [3, 4, 4, 5, 5, 5, 6]
    expect = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    for i, anc in enumerate(expect):
        assert mask[i, :3].all() and mask[i, 3:].nonzero().view(-1).tolist() == anc
    assert torch.equal(mask[:, 3:], ancestor_mask(parents))
    tgt = from_model(tiny_model("llama", vocab_size=128))
    prefix, tokens = [5, 9, 2], torch.tensor([40, 41, 42, 43, 44, 45, 46])
    cache = tgt.new_cache()
    tgt(torch.tensor([prefix]), cache=cache)
    out = tgt(tokens[None], cache=cache, attention_mask=mask[None, None], position_ids=pos[None])["logits"][0]
    for i, anc in enumerate(expect):
        plain = tgt(torch.tensor([prefix + tokens[anc].tolist()]))["logits"][0, -1]
        torch.testing.assert_close(out[i], plain, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ drafting

TREES = [EagleTreeConfig(), EagleTreeConfig(top_k=3, depth=5, nodes=20), EagleTreeConfig(kind="chain", depth=4),
         EagleTreeConfig(kind="static", paths=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])]


def test_greedy_speculative_equals_plain_greedy():
    """Random (untrained) drafts: wrong guesses exercise rejection, both caches' rollback and compaction."""
    for kind in ("llama", "qwen2"):
        tgt = from_model(tiny_model(kind, vocab_size=128, seed=3))
        d = _draft(tgt)
        for p in d.parameters():
            p.data.normal_(0, 0.3)
        for tc in TREES:
            drafter = EagleDrafter(d, tc)
            for prompt in ([1, 2, 3, 4, 5], list(range(10, 40))):
                ref = generate(tgt, NoDrafter(), prompt, 32).tokens
                res = generate(tgt, drafter, prompt, 32)
                assert res.tokens == ref, (kind, tc, prompt)
                assert max(res.tree_sizes) == (tc.nodes + 1 if tc.kind == "dynamic" else drafter.static.size)
        # sampling: deterministic top-k children are verified by the exact multi-candidate rule
        res = generate(tgt, EagleDrafter(d, TREES[1]), [1, 2, 3], 24, mode="exact", sampling={"temperature": 1.0},
                       generator=torch.Generator().manual_seed(0))
        assert len(res.tokens) == 24 and all(0 <= t < 128 for t in res.tokens)


def _oracle(kind: str):
    """A 1-layer target and a draft that *is* that layer (fc passes the token embedding through, the feature is
    layer 0 = the embedding output, the final norm comes from the target): the draft's guesses are the
    target's own, except that the draft never sees x_0. High acceptance needs correct tree attention,
    positions and cache rollback inside the draft."""
    tgt = from_model(tiny_model(kind, vocab_size=128, layers=1, seed=3))
    d = _draft(tgt, feature_layer=0)
    assert d.config.needs_final_norm
    with torch.no_grad():
        d.layer.load_state_dict(tgt.decoder_layers()[0].state_dict())
        d.fc.weight.zero_()
        d.fc.weight[:, : tgt.hidden_size] = torch.eye(tgt.hidden_size)
        d.fc.bias.zero_()
    return tgt, d


def test_oracle_draft_accepts_deep_paths_in_every_tree_kind():
    for kind in ("llama", "qwen2"):
        tgt, d = _oracle(kind)
        for tc, min_tau in ((EagleTreeConfig(top_k=2, depth=6, nodes=30), 5.0),
                            (EagleTreeConfig(kind="chain", depth=5), 4.5),
                            (EagleTreeConfig(kind="static", depth=4, nodes=20), 4.5)):
            prompt = list(range(10, 40))
            ref = generate(tgt, NoDrafter(), prompt, 60).tokens
            res = generate(tgt, EagleDrafter(d, tc), prompt, 60)
            assert res.tokens == ref
            assert res.tau >= min_tau, (kind, tc.kind, res.accepted)


def _fresh_draft_cache(d: EagleDraft, tgt, seq: list[int], n: int):
    """The draft's cache after a plain prefill of the first n pairs (f_t, x_{t+1}) of ``seq``."""
    from transformers import DynamicCache

    layer = d.config.resolved_layer
    f = tgt(torch.tensor([seq]), layers=[layer], logits=False)["hidden"][layer]  # [1, T, H]
    cache = DynamicCache(config=d.layer_config)
    d(f[:, :n], torch.tensor([seq[1:n + 1]]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None],
      cache)
    return cache


def test_draft_cache_rollback_equals_fresh_prefill_of_accepted_tokens():
    for kind in ("llama", "qwen2"):
        tgt, d = _oracle(kind)
        with torch.no_grad():  # a slightly wrong oracle: long, short and empty accepted paths
            d.fc.weight.add_(torch.randn(d.fc.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
        for tc in (EagleTreeConfig(top_k=2, depth=5, nodes=16), EagleTreeConfig(kind="static", depth=3, nodes=10)):
            drafter = EagleDrafter(d, tc)
            prompt = list(range(10, 30))
            res = generate(tgt, drafter, prompt, 33)
            assert sum(res.accepted) > 8 and any(0 < a < max(res.accepted) for a in res.accepted), res.accepted
            seq = prompt + res.tokens
            n = drafter.committed
            assert n == len(prompt) + sum(a + 1 for a in res.accepted[:-1])  # all but the last step's pending pairs
            fresh = _fresh_draft_cache(d, tgt, seq, n)
            got = drafter.cache.layers[0]
            assert got.keys.shape[-2] == n
            torch.testing.assert_close(got.keys, fresh.layers[0].keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got.values, fresh.layers[0].values, rtol=1e-4, atol=1e-5)


def test_tree_expansions_equal_sequential_drafting():
    """Each tree node's draft output equals running the draft without a cache along its path."""
    tgt = from_model(tiny_model("qwen2", vocab_size=128, seed=1))
    d = _draft(tgt)
    for p in d.parameters():
        p.data.normal_(0, 0.3)
    drafter = EagleDrafter(d, EagleTreeConfig(top_k=3, depth=4, nodes=20))
    prompt = torch.tensor([4, 8, 15, 16, 23, 42])
    layer = d.config.resolved_layer
    out = tgt(prompt[None], layers=[layer])
    root = int(out["logits"][0, -1].argmax())
    drafter.begin(prompt, {layer: out["hidden"][layer][0]})
    drafter.propose(root, None, None)
    tokens, parents, depths = drafter._cand
    assert max(depths) == 4 and len(drafter._h) == 1 + 3 * 3  # root + top_k expanded at depths 1..3
    P = len(prompt)
    for c, h in drafter._h.items():
        path = []
        a = c
        while a > 0:
            path.append(a)
            a = parents[a]
        path.reverse()
        feats = [out["hidden"][layer][0, t] for t in range(P)]  # committed pairs: true features
        ids = prompt[1:].tolist() + [root]
        for i, n in enumerate(path):  # then (draft output of the parent, node token)
            feats.append(drafter._h[0] if i == 0 else drafter._h[path[i - 1]])
            ids.append(tokens[n])
        S = len(ids)
        ref = d(torch.stack(feats)[None], torch.tensor([ids]), torch.arange(S)[None],
                torch.ones(S, S, dtype=torch.bool).tril()[None])[0, -1]
        torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-5)


def test_build_drafter_and_eval_config(tmp_path, tiny_target_dir):
    from draftheads.eval.drafters import build_drafter

    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    _draft(tgt).save_pretrained(tmp_path / "d", tgt.identity)
    cfg = compose("eval", [f"checkpoint={tmp_path / 'd'}", "target=hf", f"target.name={tiny_target_dir}"])
    # tree.select=auto leaves the knobs null (chosen by eval/autotree.py); the drafter's own defaults are 10, 6, 60
    assert cfg.tree.kind == "auto" and cfg.tree.select == "auto" and cfg.tree.top_k is None and cfg.tree.nodes is None
    drafter, desc = build_drafter(cfg.drafter, tgt, cfg.checkpoint, cfg.tree, tgt.dtype)
    assert isinstance(drafter, EagleDrafter) and desc["drafter"] == "eagle" and desc["tree_kind"] == "dynamic"
    assert desc["tree_size"] == 61 and desc["tree_depth"] == 6 and drafter.layers == (4,)
    cfg = compose("eval", ["tree.kind=chain", "tree.depth=3"])
    drafter, desc = build_drafter("eagle", tgt, str(tmp_path / "d"), cfg.tree, tgt.dtype)
    assert desc["tree_kind"] == "chain" and desc["tree_size"] == 4
    with pytest.raises(ValueError, match="tree.kind must be"):
        build_drafter("eagle", tgt, str(tmp_path / "d"), compose("eval", ["tree.kind=bushy"]).tree, tgt.dtype)
    with pytest.raises(ValueError, match="static trees only"):
        build_drafter("medusa-init", tgt, None, compose("eval", ["tree.kind=dynamic"]).tree, tgt.dtype)
    assert compose("eagle", ["features.dir=/some/cache"]).features.dir == "/some/cache"
    feats = compose("features", ["layers=[0,-1]", "dtype=fp32"])
    assert list(feats.layers) == [0, -1] and feats.dtype == "fp32"


def test_acceptance_job_with_an_eagle_checkpoint(tmp_path, tiny_target_dir):
    """The eval job picks the EAGLE drafter from the checkpoint and reproduces plain greedy (fp32)."""
    from draftheads.eval.acceptance import main as eval_main

    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    _draft(tgt).save_pretrained(tmp_path / "d", tgt.identity)
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["count from one", "again"]}) + "\n")
    cfg = compose("eval", [
        "target=hf", f"target.name={tiny_target_dir}", "target.dtype=fp32", "target.local_files_only=true",
        f"checkpoint={tmp_path / 'd'}", f"questions={qfile}", "max_new_tokens=20", "compare_plain=true",
        f"out={tmp_path / 'eval.json'}", "tree.top_k=4", "tree.nodes=12",
        "tree.select=default"])  # depth 6 (the family default); tree=auto is tested in tests/test_autotree.py
    res = eval_main(cfg)
    assert res["drafter"]["drafter"] == "eagle" and res["drafter"]["tree_size"] == 13
    assert res["greedy_identical"]["identical"] == res["greedy_identical"]["turns"] == 2
    assert len(res["summary"]["accept_at_depth"]) == 6
    assert_tau_accounts_for_tokens(res["summary"]["tau"], res["rows"], 6)
    # the first turn replayed outside the job: the same drafter decoding the same prompt accepts the same drafts
    from draftheads.data_prep.template import prompt_ids
    from draftheads.eval.drafters import build_drafter

    drafter, _ = build_drafter("eagle", tgt, str(tmp_path / "d"), cfg.tree, tgt.dtype)
    ids = prompt_ids(tgt.tokenizer, [{"role": "user", "content": "count from one"}])
    first = generate(tgt, drafter, ids, 20, {tgt.tokenizer.eos_token_id})
    assert res["rows"][0]["accepted"] == first.accepted and res["rows"][0]["new_tokens"] == len(first.tokens)


# ------------------------------------------------------------------------------------------ simulated τ

def _greedy_batch(tgt, prompt: list[int], n: int) -> dict[str, torch.Tensor]:
    """A held-out row that is the target's own greedy continuation (assistant tokens) of ``prompt``."""
    gen = generate(tgt, NoDrafter(), prompt, n).tokens
    ids = torch.tensor([prompt + gen])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.tensor([[0] * len(prompt) + [1] * len(gen)])}


def _feature_oracle(wrong_from: int | None = None, calls: list | None = None):
    """A stub draft forward whose output at draft position p is the target's true top-layer feature f_{p+1} (taken
    from the teacher-forced block's input), so lm_head of it is the target's greedy next token: every depth's top-1
    is the reference. Negated from block ``wrong_from`` on (0-based: depth wrong_from+1), which makes the reference
    the draft's *last* choice there."""
    state: dict[str, torch.Tensor] = {}

    def forward(features, next_ids, position_ids, allowed, cache=None):
        block = allowed.shape[-1] // features.shape[1] - 1
        if block == 0:
            state["f"] = features  # f_t, t = 0..T-2
        if calls is not None:
            calls.append({"features": features, "next_ids": next_ids, "pos": position_ids, "allowed": allowed,
                          "cache": cache})
        f = state["f"]
        idx = (position_ids + 1).clamp(max=f.shape[1] - 1)
        out = torch.gather(f, 1, idx[..., None].expand(-1, -1, f.shape[-1]))
        if wrong_from is not None and block >= wrong_from:
            out = -out
        state["last"] = out
        return out

    return forward


def test_acceptance_ranks_roll_the_draft_out_along_the_reference(tiny_target_dir):
    """Depth d at position t: the draft reads (its own depth d-1 output at t, x_{t+d}) at position t+d-1, attending
    to the teacher-forced pairs <= t and its own chain at t; its candidates are checked against x_{t+1+d}. Scored:
    positions whose next D+1 tokens are the target's greedy continuation."""
    from draftheads.train.eagle import EagleObjective

    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    D, P = 3, 8
    batch = _greedy_batch(tgt, list(range(20, 20 + P)), 16)
    ids = batch["input_ids"]
    S = ids.shape[1] - 1
    obj = EagleObjective(_draft(tgt), tgt, noise="none", sim_depth=D)
    calls: list = []
    outs: list = []
    oracle = _feature_oracle(calls=calls)

    def recording(*a, **k):
        outs.append(oracle(*a, **k))
        return outs[-1]

    obj.draft.forward = recording
    ranks, considered = obj.acceptance_ranks(batch, top_k=5)
    assert considered == 16 and ranks.shape == (16 - D, D)  # t = P-1 .. T-D-2
    assert (ranks == 0).all()  # the oracle's top-1 is the reference at every depth
    assert len(calls) == D
    f = tgt(ids, logits=False)["last_hidden"]
    torch.testing.assert_close(calls[0]["features"], f[:, :S])  # block 0: the target's features f_t
    for s, c in enumerate(calls):
        assert c["next_ids"][0, : S - s].tolist() == ids[0, 1 + s:].tolist()  # x_{t+1+s}
        assert c["pos"].tolist() == [list(range(s, S + s))]  # position t + s
        assert c["allowed"].shape == (1, S, (s + 1) * S)
        assert torch.equal(c["allowed"][0, :, :S], torch.ones(S, S, dtype=torch.bool).tril())
        for j in range(1, s + 1):  # earlier chain entries: the same position only
            assert torch.equal(c["allowed"][0, :, j * S:(j + 1) * S], torch.eye(S, dtype=torch.bool))
        if s:
            assert c["features"] is outs[s - 1] and c["cache"] is calls[0]["cache"]  # fed back, one cache
    obj.draft.forward = _feature_oracle(wrong_from=1)  # right at depth 1, wrong (last choice) below
    ranks, _ = obj.acceptance_ranks(batch, top_k=5)
    assert (ranks[:, 0] == 0).all() and (ranks[:, 1:] == 5).all()
    cut = ids.clone()  # leave the greedy path at token P+6: the D+1 windows that contain it are not scored
    cut[0, P + 6] = (int(cut[0, P + 6]) + 1) % 400
    ranks, considered = obj.acceptance_ranks({**batch, "input_ids": cut}, top_k=5)
    assert considered == 16 and 6 - D <= ranks.shape[0] <= 16 - D - (D + 1)


@pytest.mark.parametrize("wrong_from, tau", [(None, 5.0), (2, 3.0), (0, 1.0)])
def test_simulated_tau_of_oracle_and_wrong_drafts(tmp_path, tiny_target_dir, chat_file, wrong_from, tau):
    """Through the loop's simulated τ: a draft whose proposals are the target's greedy tokens gets the maximum
    1 + D, one right for two depths gets 3, one always wrong gets 1."""
    from datasets import Dataset

    from draftheads.data_prep.dataset import collate
    from draftheads.train.eagle import EagleObjective
    from draftheads.train.loop import Trainer, make_accelerator

    D = 4
    cfg = compose("eagle", tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "run", **{
        "train.sim_tau_examples": 5, "train.batch_size": 4}))
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(6):
        b = _greedy_batch(tgt, torch.randint(10, 300, (6,), generator=g).tolist(), 12)
        rows.append({"input_ids": b["input_ids"][0].tolist(), "loss_mask": b["loss_mask"][0].tolist()})
    data = Dataset.from_list(rows)
    obj = EagleObjective(_draft(tgt), tgt, noise="none", sim_depth=D)
    trainer = Trainer(cfg, make_accelerator(cfg), obj, data, lambda r: collate(r, 0), tmp_path / "run", heldout=data)
    obj.draft.forward = _feature_oracle(wrong_from)
    m = trainer.simulated_tau()
    # 5 rows of 6 + 12 tokens: t = 5 .. 16-D scored, of the 12 positions followed by an assistant token
    assert m["sim_tau/positions"] == 5 * (12 - D) and m["sim_tau/coverage"] == pytest.approx((12 - D) / 12)
    assert m["sim_tau/chain"] == pytest.approx(tau)
    good = D if wrong_from is None else wrong_from
    assert [m[f"sim_accept/chain@{d}"] for d in range(1, D + 1)] == [1.0] * good + [0.0] * (D - good)
    assert "sim_tau/tree" not in m  # EAGLE's eval tree is dynamic: only the chain is simulated


def test_simulated_tau_equals_real_eagle_chain_decoding_at_every_step_start():
    """On a greedy continuation, the simulated chain accepts at each step start exactly what EAGLE chain decoding
    (eval.eagle_drafter, its KV cache and rollback) accepts there."""
    from draftheads.train.eagle import EagleObjective
    from draftheads.train.loop import accepted_lengths

    D = 4
    for kind in ("llama", "qwen2"):
        tgt, d = _oracle(kind)
        with torch.no_grad():  # a slightly wrong oracle: long, short and empty accepted runs
            d.fc.weight.add_(torch.randn(d.fc.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
        prompt = list(range(10, 30))
        batch = _greedy_batch(tgt, prompt, 48)
        ids = batch["input_ids"]
        T = ids.shape[1]
        res = generate(tgt, EagleDrafter(d, EagleTreeConfig(kind="chain", depth=D)), prompt, 48)
        assert res.tokens == ids[0, len(prompt):].tolist()
        obj = EagleObjective(d, tgt, noise="none", sim_depth=D).eval()
        ranks, considered = obj.acceptance_ranks(batch)
        first = len(prompt) - 1  # every t >= P-1 with D+1 greedy tokens after it is scored
        assert considered == 48 and ranks.shape[0] == T - D - 1 - first
        sim = accepted_lengths(ranks)
        t, checked = first, []
        for a in res.accepted:  # step i starts at t_i; t_{i+1} = t_i + a_i + 1
            if t + D + 1 <= T - 1:
                assert int(sim[t - first]) == a, (kind, t, a, int(sim[t - first]))
                checked.append(a)
            t += a + 1
        assert len(checked) >= 5 and 0 in checked and D in checked and any(0 < a < D for a in checked), checked
