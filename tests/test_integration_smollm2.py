"""Integration on the embedded SmolLM2-135M target: prepare a ShareGPT slice, train a few steps,
evaluate with the acceptance job (greedy speculative == plain greedy in fp32)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, assert_tau_accounts_for_tokens, compose, deepest_draft


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_prepare_train_eval(tmp_path):
    out = tmp_path / "run"
    cfg = compose("medusa", [
        "data=sharegpt_small", "data.max_conversations=40", "data.max_length=128",
        f"data.cache_dir={tmp_path / 'data'}", f"out_dir={out}", "logging.wandb=disabled",
        "train.device=cpu", "train.batch_size=2", "train.max_steps=3", "train.log_every=1",
        "train.save_every=0", "train.eval_tokens=500", "head.share_lm_head=true", "optim.lr=1e-3",
        "optim.warmup_steps=0"])
    from draftheads.train.medusa import main as train_main

    summary = train_main(cfg)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(l == l and 0 < l < 100 for l in losses)
    assert summary["steps"] == 3
    ckpt = json.loads((out / "final" / "config.json").read_text())
    assert ckpt["target"]["name"] == "smollm2-135m" and ckpt["target"]["vocab_size"] == 49152
    assert ckpt["target"]["revision"].startswith("gguf-sha256:")

    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Name three colors.",
                                                                                   "Now two more."]}) + "\n")
    from draftheads.eval.acceptance import main as eval_main

    ecfg = compose("eval", [f"checkpoint={out / 'final'}", f"questions={qfile}", "max_new_tokens=24",
                            "target.dtype=fp32", "compare_plain=true", f"out={tmp_path / 'eval.json'}",
                            "tree.size=16"])
    res = eval_main(ecfg)
    assert res["greedy_identical"]["identical"] == res["greedy_identical"]["turns"] == 2
    assert_tau_accounts_for_tokens(res["summary"]["tau"], res["rows"], deepest_draft(res["drafter"]))


@pytest.mark.slow
@pytest.mark.integration
def test_decode_attention_benchmark_times_both_kernels_on_real_prompts(tmp_path, monkeypatch):
    """Both attention kernels decode the same real prompts; with the script's clock replaced (sdpa's timed batch
    takes 2 s, eager's 1 s) its figures are known: 3 prompts x 4 new tokens = 12 tokens, so 6 and 12 tokens/s, and
    eager is 2x faster. Timing itself is the benchmark's job, not a test's."""
    from types import SimpleNamespace

    from draftheads.scripts import bench_decode_attn

    ticks = iter([0.0, 2.0, 10.0, 11.0])  # start/end of sdpa's timed batch, then of eager's
    monkeypatch.setattr(bench_decode_attn, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    out = tmp_path / "decode_attn.json"
    res = bench_decode_attn.main(["--device", "cpu", "--dtype", "fp32", "--batch", "3", "--new", "4",
                                  "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["tokens_per_s"] == {"sdpa": 6.0, "eager": 12.0}
    assert res["faster"] == "eager" and res["eager_speedup"] == 2.0


ZOO_HEADS = sorted(p for p in (REPO / "zoo").iterdir() if p.is_dir()) if (REPO / "zoo").is_dir() else []


def test_zoo_stays_small():
    """zoo/ holds published heads in the Hub layout, ≤ 25 MB of weights each and ≤ 40 MB altogether."""
    total = 0
    for head in ZOO_HEADS:
        files = {f.name for f in head.iterdir()}
        assert {"model.safetensors", "config.json", "README.md", "tau_table.json"} <= files, head
        size = (head / "model.safetensors").stat().st_size
        assert size <= 25 * 2**20, (head, size)
        total += sum(f.stat().st_size for f in head.rglob("*") if f.is_file())
        assert "## Measured τ" in (head / "README.md").read_text()
    assert total <= 40 * 2**20


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("head", ZOO_HEADS, ids=lambda p: p.name)
def test_zoo_head_loads_decodes_exactly_and_exports(head, tmp_path):
    """A published head loads on the embedded target, decodes token-identically to plain greedy (fp32) and, if it
    is an EAGLE-3 draft, exports to the speculators layout."""
    from draftheads.eval.acceptance import main as eval_main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "writing",
                                 "turns": ["Write two sentences about the sea."]}) + "\n")
    res = eval_main(compose("eval", [f"checkpoint={head}", f"questions={qfile}", "max_new_tokens=32",
                                     "target.dtype=fp32", "compare_plain=true", "tree.select=default",
                                     f"out={tmp_path / 'eval.json'}"]))
    assert res["greedy_identical"]["identical"] == res["greedy_identical"]["turns"] == 1
    assert res["summary"]["tau"] > 1.0  # a trained head accepts something on 32 tokens
    if json.loads((head / "config.json").read_text())["family"] == "eagle3":
        from draftheads.scripts.export import main as export_main

        s = export_main(compose("export", [f"checkpoint={head}", f"out={tmp_path / 'export'}"]))
        assert (tmp_path / "export" / "model.safetensors").is_file() and s
