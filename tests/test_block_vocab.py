"""A block draft with its own vocabulary (``head.draft_vocab_size``): the loss and the drafted ids stay in it, greedy
decoding still equals plain, training counts the vocabulary and stores it, the sampled q is a distribution over
target ids, and the dflash export carries the reduced lm_head and d2t/t2d."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import compose, tiny_model, tiny_train_overrides
from draftheads.data_prep.features import batch_hidden
from draftheads.eval.block_drafter import BlockDrafter
from draftheads.eval.drafters import build_drafter
from draftheads.eval.generate import NoDrafter, generate
from draftheads.heads.block import BlockDraft, block_config_for
from draftheads.heads.block_export import export
from draftheads.heads.target import from_model, load_target
from draftheads.train.block import BlockObjective
from test_block import _batch, scored_and_drafted

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = [0, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31]  # 12 of the tiny target's 64 ids


def _draft(tgt, vocab=VOCAB, context: str = "kv", block: int = 4, seed: int = 0) -> BlockDraft:
    torch.manual_seed(seed)
    d = BlockDraft(block_config_for(tgt, [1, 2, 3], 2, block, context, draft_vocab_size=len(vocab)), tgt)
    for n, p in d.named_parameters():
        if n != "lm_head.weight":  # the vocabulary's rows of the target's head stay as set_vocab copies them
            p.data.normal_(0, 0.3) if p.ndim > 1 else p.data.uniform_(0.5, 1.5)
    d.set_vocab(torch.tensor(vocab))
    return d


@pytest.mark.parametrize("context", ["prefix", "kv"])
def test_the_draft_vocabulary_is_the_target_heads_rows_and_decoding_stays_exact(context):
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=3))
    d = _draft(tgt, context=context)
    assert d.out_vocab == len(VOCAB) and d.target_ids().tolist() == VOCAB
    torch.testing.assert_close(d.lm_head.weight, tgt.lm_head().weight[VOCAB])
    assert not d.lm_head.weight.requires_grad  # frozen like the full head
    h = torch.randn(5, tgt.hidden_size)
    torch.testing.assert_close(d.logits(h), tgt.lm_head()(h)[:, VOCAB])  # the full head's columns, in id order
    accepted = 0
    for prompt in ([1, 2, 3, 4, 5], torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(1)).tolist()):
        ref = generate(tgt, NoDrafter(), prompt, 40).tokens
        drafter = BlockDrafter(d)
        res = generate(tgt, drafter, prompt, 40)
        assert res.tokens == ref, prompt
        accepted += sum(res.accepted)
    # drafts are target ids inside the vocabulary
    seq = torch.tensor([[1, 2, 3]])
    drafter.begin(seq[0], {k: v[0] for k, v in tgt(seq, layers=[1, 2, 3], logits=False)["hidden"].items()})
    tree = drafter.propose(4, None, None)
    assert set(tree.tokens[1:].tolist()) <= set(VOCAB)


@pytest.mark.parametrize("context", ["prefix", "kv"])
def test_training_scores_in_vocabulary_labels_and_sampling_reports_target_ids(context):
    """The block training scores is what the drafter samples from, as a distribution over target ids that is zero
    outside the vocabulary; labels outside it leave the CE and count as top-1 misses."""
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=3))
    d = _draft(tgt, context=context)
    obj = BlockObjective(d, tgt, anchors=4).eval()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    hidden = batch_hidden(_batch(ids), tgt, obj.layers)
    p_train, tree = scored_and_drafted(obj, ids, hidden, 9)  # [n-1, DV], and the drafter's tree
    q = tree.draft_probs[1:]  # [n-1, V]
    assert q.shape[1] == 64 and float(q[:, [i for i in range(64) if i not in VOCAB]].abs().max()) == 0.0
    torch.testing.assert_close(q[:, VOCAB], p_train, rtol=1e-4, atol=1e-6)
    assert set(tree.tokens[1:].tolist()) <= set(VOCAB)
    # the loss: only in-vocabulary labels are scored; top-1 counts every label (held-out anchors: a fixed draw)
    batch = _batch(ids)
    loss, stats = obj(batch)
    anchors, valid = obj._anchors(batch)
    assert torch.isfinite(loss)
    outside = 0
    every, ok_every = obj._labels(batch, anchors, valid)  # [B, m, n-1]
    for j in range(1, 4):
        labels, ok = every[..., j - 1], ok_every[..., j - 1]
        inside = torch.isin(labels[ok], torch.tensor(VOCAB))
        assert float(stats[f"top1/j{j}"][1]) == int(ok.sum())
        assert float(stats[f"ce/j{j}"][1]) == int(inside.sum())
        outside += int((~inside).sum())
    assert outside > 0  # the case ran


def test_training_counts_the_vocabulary_saves_it_and_eval_loads_it(tmp_path, tiny_target_dir, chat_file):
    from draftheads.train.block import main

    kw = {"train.max_steps": 12, "optim.lr": 1e-2, "head.context": "kv", "head.context_layers": "[1,2,3]",
          "head.block_size": 4, "head.anchors": 8, "head.draft_vocab_size": 24}
    main(compose("block", tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "run", **kw)))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sum(losses[s] for s in (10, 11, 12)) < sum(losses[s] for s in (1, 2, 3)), losses
    cfg = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert cfg["head_config"]["draft_vocab_size"] == 24 and cfg["draft_vocab"]["draft_vocab_size"] == 24
    assert 0 < cfg["draft_vocab"]["coverage"] <= 1.0
    t = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert t["lm_head.weight"].shape == (24, 64) and t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})
    vocab = (torch.arange(24) + t["d2t"]).tolist()
    torch.testing.assert_close(t["lm_head.weight"], tgt.lm_head().weight[vocab])  # frozen: still the target's rows
    drafter, desc = build_drafter("auto", tgt, str(tmp_path / "run" / "final"), OmegaConf.create({"depth": 3}),
                                  tgt.dtype)
    assert desc["drafter"] == "block" and drafter.draft.target_ids().tolist() == vocab
    prompt = [1, 5, 9, 12, 7]
    assert generate(tgt, drafter, prompt, 24).tokens == generate(tgt, NoDrafter(), prompt, 24).tokens
    bad = tmp_path / "bad"
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        main(compose("block", tiny_train_overrides(tiny_target_dir, chat_file, bad,
                                                   **{**kw, "head.draft_vocab_size": 10**6})))


def test_the_dflash_export_carries_the_reduced_head_and_the_mapping(tmp_path, tiny_target_dir):
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})
    d = _draft(tgt)
    out = export(d, tgt, tmp_path / "e", str(tiny_target_dir), torch.bfloat16)
    t = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(VOCAB) and cfg["transformer_layer_config"]["vocab_size"] == tgt.vocab_size
    assert t["lm_head.weight"].shape == (len(VOCAB), 64) and t["lm_head.weight"].dtype == torch.bfloat16
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool  # mappings keep their dtypes
    assert (torch.arange(len(VOCAB)) + t["d2t"]).tolist() == VOCAB and t["t2d"].nonzero()[:, 0].tolist() == VOCAB


@pytest.mark.slow  # a child process with its own Python
def test_a_draft_vocabulary_export_round_trips_through_speculators(tmp_path, tiny_target_dir):
    """speculators loads the reduced-vocabulary export (lm_head, d2t, t2d from the file) and its fp32 block logits
    over the draft vocabulary equal ours."""
    from test_export import speculators_python
    from draftheads.heads.block_export import speculators_roundtrip

    spec_py = speculators_python()
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})
    d = _draft(tgt, seed=3)
    export(d, tgt, tmp_path / "e", str(tiny_target_dir), torch.bfloat16)
    rt = speculators_roundtrip(d, tgt, tmp_path / "e", spec_py)
    assert rt["missing_in_file"] == rt["unexpected_in_file"] == rt["value_mismatch"] == []
    assert rt["fp32_max_abs_diff"] < 1e-5 * rt["logit_scale"] and rt["fp32_argmax_equal"] == 1.0
