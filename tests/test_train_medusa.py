"""Medusa heads and trainer: identity init, label shift, loss falls, checkpoints, exact resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import compose, tiny_model, tiny_train_overrides
from draftheads.data_prep.dataset import shifted_valid
from draftheads.heads.medusa import MedusaConfig, MedusaHeads, medusa_config_for
from draftheads.heads.target import from_model, load_target
from draftheads.train.medusa import MedusaObjective, main


def test_identity_init_equals_target_head():
    tgt = from_model(tiny_model("llama", vocab_size=128))
    for share in (False, True):
        heads = MedusaHeads(medusa_config_for(tgt, 3, 2, share), tgt.lm_head())
        h = torch.randn(2, 5, tgt.hidden_size)
        logits = heads(h)  # [K, 2, 5, V]
        ref = tgt.lm_head()(h)
        for k in range(3):
            torch.testing.assert_close(logits[k], ref, rtol=1e-5, atol=1e-5)
        assert len(heads.blocks[0]) == 2 and heads.blocks[0][0] is not heads.blocks[0][1]  # distinct blocks
        n_params = sum(p.numel() for p in heads.parameters())
        own = 0 if share else 3 * 128 * tgt.hidden_size
        assert n_params == 3 * 2 * (tgt.hidden_size ** 2 + tgt.hidden_size) + own


def test_label_shift_per_head():
    """Head k (1-based) at position t must be scored on token t+k+1, only where that token is an assistant token."""
    V, H, T, K = 50, 16, 12, 3
    tgt = from_model(tiny_model("llama", vocab_size=V, hidden=H))
    heads = MedusaHeads(MedusaConfig(num_heads=K, num_layers=0, hidden_size=H, vocab_size=V), tgt.lm_head())
    ids = torch.tensor([[3, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1]])
    # features: one-hot of the position (H >= T); head k's projection maps position t to token ids[t+k+1]
    hidden = torch.eye(H)[:T][None]  # [1, T, H]
    with torch.no_grad():
        for k in range(1, K + 1):
            W = torch.zeros(V, H)
            for t in range(T - k - 1):
                W[ids[0, t + k + 1], t] = 50.0
            heads.lm_heads[k - 1].weight.copy_(W)
    obj = MedusaObjective(heads, tgt)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask, "hidden_last": hidden}
    loss, stats = obj(batch)
    for k in range(1, K + 1):
        expected_n = int(loss_mask[0, k + 1:].sum())
        assert stats[f"top1/{k}"][1].item() == expected_n
        assert stats[f"top1/{k}"][0].item() == expected_n  # every counted label is the shifted token
    assert loss.item() < 1e-6
    assert obj.num_targets(batch).item() == int(loss_mask[0, 2:].sum())
    # one position off -> nothing right
    shifted = dict(batch, input_ids=torch.roll(ids, 1, dims=1))
    _, stats = obj(shifted)
    assert stats["top1/1"][0].item() == 0


def test_shifted_valid_respects_documents_in_packed_rows():
    b = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "attention_mask": torch.ones(1, 6, dtype=torch.long),
         "loss_mask": torch.tensor([[0, 1, 1, 0, 1, 1]]), "doc_ids": torch.tensor([[0, 0, 0, 1, 1, 1]])}
    v = shifted_valid(b, 2)  # position t -> label t+2
    assert v.tolist() == [[True, False, False, True]]  # t=1 -> 3 (mask 0); t=2 -> 4 crosses documents


def _run(tmp_path, target_dir, chat_file, name, **kw):
    out = tmp_path / name
    cfg = compose("medusa", tiny_train_overrides(target_dir, chat_file, out, **kw))
    return main(cfg), out


def test_training_lowers_loss_and_checkpoint_round_trips(tmp_path, tiny_target_dir, chat_file):
    summary, out = _run(tmp_path, tiny_target_dir, chat_file, "run",
                        **{"train.max_steps": 40, "optim.lr": 3e-3, "train.log_every": 5, "head.num_heads": 3,
                           "train.eval_every": 12})
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    assert rows[-1]["heldout_top1/1"] > 0.2  # the synthetic chats are learnable
    # eval_every need not be a multiple of log_every: steps 12, 24, 36 still get a row with held-out metrics
    assert [r["step"] for r in rows if "heldout_top1/1" in r][:3] == [12, 24, 36]
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    heads = MedusaHeads.from_pretrained(out / "final", tgt)
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["target"]["vocab_size"] == tgt.vocab_size and cfg["target"]["hidden_size"] == tgt.hidden_size
    assert cfg["family"] == "medusa" and cfg["head_config"]["num_heads"] == 3
    assert len(cfg["rank_accuracy"]) == 3 and len(cfg["rank_accuracy"][0]) == 10
    from safetensors.torch import load_file

    saved = load_file(str(out / "final" / "model.safetensors"))
    for k, v in heads.state_dict().items():
        torch.testing.assert_close(v, saved[k])
    assert (out / "training.png").stat().st_size > 1000


def test_checkpoint_for_another_target_is_refused(tmp_path, tiny_target_dir, tiny_qwen2_dir):
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    heads = MedusaHeads(medusa_config_for(tgt, 2, 1, False), tgt.lm_head())
    heads.save_pretrained(tmp_path / "h", tgt.identity)
    other = from_model(tiny_model("llama", vocab_size=300))
    with pytest.raises(ValueError, match="vocab_size is 400 there"):
        MedusaHeads.from_pretrained(tmp_path / "h", other)
    same_shape = from_model(tiny_model("llama", seed=5))
    with pytest.raises(ValueError, match="fingerprint"):
        MedusaHeads.from_pretrained(tmp_path / "h", same_shape)
    MedusaHeads.from_pretrained(tmp_path / "h", same_shape, allow_target_mismatch=True)
    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete: missing model.safetensors"):
        MedusaHeads.from_pretrained(tmp_path / "h", tgt)


def test_resume_continues_exactly(tmp_path, tiny_target_dir, chat_file):
    kw = {"train.max_steps": 8, "train.save_every": 4, "train.keep_last": 5, "optim.lr": 3e-3}
    _, full = _run(tmp_path, tiny_target_dir, chat_file, "full", **kw)
    ref = {r["step"]: r["loss"] for r in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())
           if "loss" in r}
    # simulate a job killed after step 6: step-4 is the last complete checkpoint
    shutil.copytree(full, tmp_path / "killed")
    killed = tmp_path / "killed"
    shutil.rmtree(killed / "checkpoints" / "step-000008")
    shutil.rmtree(killed / "final")
    (killed / "checkpoints" / ".step-000008.tmp").mkdir()  # a half-written checkpoint must be ignored
    cfg = compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, killed, **kw, **{"train.resume": "true"}))
    main(cfg)
    got = {r["step"]: r["loss"] for r in map(json.loads, (killed / "metrics.jsonl").read_text().splitlines())
           if "loss" in r}
    assert sorted(got) == list(range(1, 9))
    for s in range(5, 9):
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7), (s, got[s], ref[s])
    a = MedusaHeads.from_pretrained(full / "final", load_target({"name": str(tiny_target_dir), "dtype": "fp32"}))
    b = MedusaHeads.from_pretrained(killed / "final", load_target({"name": str(tiny_target_dir), "dtype": "fp32"}))
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(v, w, rtol=1e-6, atol=1e-7)


def test_resume_refuses_a_different_global_batch(tmp_path, tiny_target_dir, chat_file):
    kw = {"train.max_steps": 2, "train.save_every": 1}
    _, out = _run(tmp_path, tiny_target_dir, chat_file, "r", **kw)
    shutil.rmtree(out / "final")
    cfg = compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, out,
                                                 **{"train.resume": "true", "train.max_steps": 4,
                                                    "train.save_every": 1, "train.batch_size": 4}))
    with pytest.raises(ValueError, match="global batch"):
        main(cfg)


def test_empty_heldout_split_loads(tmp_path, chat_file):
    from conftest import CHATML, make_tokenizer
    from draftheads.data_prep.dataset import DataConfig, prepare_data

    cfg = DataConfig(source="file", path=str(chat_file), heldout_fraction=0.0, max_length=64,
                     cache_dir=str(tmp_path))
    d = prepare_data(cfg, make_tokenizer(CHATML))
    assert len(d.heldout) == 0 and len(d.train) == 240
    assert len(prepare_data(cfg, make_tokenizer(CHATML)).heldout) == 0  # the cached copy reads back too


def test_rerun_without_resume_is_refused_and_overwrite_starts_over(tmp_path, tiny_target_dir, chat_file):
    """Rerunning a training command into an earlier run's folder without train.resume=true used to start over
    silently, appending to its metrics and pruning through keep_last; now it names both ways out."""
    kw = {"train.max_steps": 4, "train.save_every": 2, "train.keep_last": 5, "train.log_every": 1}
    _, out = _run(tmp_path, tiny_target_dir, chat_file, "r", **kw)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    with pytest.raises(ValueError, match=r"step-000004\).*train\.resume=true.*train\.overwrite=true"):
        _run(tmp_path, tiny_target_dir, chat_file, "r", **{**kw, "train.max_steps": 2})
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]  # untouched
    _run(tmp_path, tiny_target_dir, chat_file, "r", **{**kw, "train.max_steps": 2, "train.overwrite": "true"})
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]  # its own; step 4 gone
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert set(steps) == {1, 2}  # the earlier run's rows (steps 3, 4) are gone, not mixed in
