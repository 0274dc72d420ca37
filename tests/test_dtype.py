"""`auto` precision: bf16 only where the hardware computes it natively (AVX2-only CPUs emulate it, far slower)."""

from __future__ import annotations

import pytest
import torch

import draftheads.heads.target as target_mod
import draftheads.train.loop as loop
from draftheads.heads.target import DTYPE_NAMES, bf16_is_fast, dtype_name, parse_dtype


@pytest.mark.parametrize("caps, fast", [
    ({"avx2": True, "amx_bf16": False, "avx512_bf16": False}, False),  # e.g. AMD EPYC (Zen 3) without AVX-512
    ({"avx2": True, "amx_bf16": True, "avx512_bf16": True}, True),  # Sapphire Rapids and later
    ({"avx2": True, "amx_bf16": False, "avx512_bf16": True}, True),  # Cooper Lake, Zen 4
])
def test_auto_dtype_follows_cpu_bf16_support(monkeypatch, caps, fast):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(caps))
    assert bf16_is_fast("cpu") is fast
    assert parse_dtype("auto", "cpu") == (torch.bfloat16 if fast else torch.float32)
    assert loop.resolve_mixed_precision("auto", "cpu") == ("bf16" if fast else "no")


def test_older_torch_reads_cpuinfo_flags(monkeypatch, tmp_path):
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    real_path = target_mod.Path
    cpuinfo = tmp_path / "cpuinfo"

    def fake_path(p, *a):
        return real_path(cpuinfo) if str(p) == "/proc/cpuinfo" else real_path(p, *a)

    monkeypatch.setattr(target_mod, "Path", fake_path)
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 fma\n")
    assert not bf16_is_fast("cpu")
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert bf16_is_fast("cpu")


def test_explicit_choices_are_kept_and_bad_ones_named():
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("fp32", "cuda") == torch.float32
    assert loop.resolve_mixed_precision("no", "cpu") == "no"
    assert loop.resolve_mixed_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="expected auto or one of"):
        parse_dtype("bf8")
    with pytest.raises(ValueError, match=r"train.mixed_precision must be auto, no, bf16 or fp16, got 'fp8'"):
        loop.resolve_mixed_precision("fp8", "cpu")


def test_dtype_names_round_trip():
    for dt, name in DTYPE_NAMES.items():
        assert dtype_name(dt) == name and parse_dtype(name) == dt


def test_default_target_dtype_resolves_on_this_machine():
    """The shipped default is `auto` and resolves to a dtype this host computes natively."""
    from hydra import compose, initialize_config_dir
    from pathlib import Path

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="medusa")
    assert cfg.target.dtype == "auto" and cfg.train.mixed_precision == "auto"
    assert parse_dtype(cfg.target.dtype) == (torch.bfloat16 if bf16_is_fast() else torch.float32)


def test_bench_dtype_writes_json_with_both_dtypes(tmp_path):
    import json

    from draftheads.scripts import bench_dtype

    out = tmp_path / "dtype.json"
    res = bench_dtype.main(["--tokens", "64", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert set(res["matmul_gflops"]) == {"fp32", "bf16"} and all(v > 0 for v in res["matmul_gflops"].values())
    assert res["auto_picks"] == ("bf16" if bf16_is_fast() else "fp32")


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_bench_dtype_derives_its_verdict_from_the_timings(tmp_path, monkeypatch, fast_bf16):
    """Known throughputs in, known speedup and verdict out (a real run's figures cannot pin the arithmetic):
    bf16 at 10 GFLOP/s against fp32 at 40 is a 0.25x speedup, so auto picking bf16 is the wrong choice."""
    from draftheads.scripts import bench_dtype

    monkeypatch.setattr(bench_dtype, "matmul_gflops", lambda dt, *a: {torch.float32: 40.0, torch.bfloat16: 10.0}[dt])
    monkeypatch.setattr(bench_dtype, "parse_dtype", lambda name, device: torch.bfloat16 if fast_bf16 else torch.float32)
    res = bench_dtype.main(["--out", str(tmp_path / "d.json")])
    assert res["matmul_gflops"] == {"fp32": 40.0, "bf16": 10.0} and res["bf16_speedup"] == 0.25
    assert res["auto_picks"] == ("bf16" if fast_bf16 else "fp32")
    assert res["auto_is_faster_choice"] is (not fast_bf16)


def test_target_lm_head_gets_packed_rows_when_transformers_slices_the_last_position():
    """transformers' ``logits_to_keep`` hands the lm_head the last position sliced off [B, S, H]; torch multiplies
    such an input by an expanded weight (on CPU in bf16: a copy of the lm_head per call, and at a batched prefill a
    failed allocation that turns oneDNN off process-wide). The target's pre-hook packs it: the layer sees packed
    strides, and the logits equal those of the packed rows bit for bit."""
    from conftest import tiny_model

    from draftheads.heads.target import from_model

    model = tiny_model("llama").to(torch.bfloat16)
    from_model(model)
    head = model.get_output_embeddings()
    from_model(model)  # wrapping the model again does not stack a second hook
    assert len(head._forward_pre_hooks) == 1
    H = model.config.hidden_size
    seen: list[tuple[int, ...]] = []
    head.register_forward_pre_hook(lambda m, a: seen.append(a[0].stride()))  # runs after the target's hook
    h = torch.randn(3, 7, H, dtype=torch.bfloat16)
    with torch.no_grad():
        out = head(h[:, -1:, :])  # [3, 1, V]
        ref = head(torch.stack([h[i, -1:] for i in range(3)]))  # packed rows
        assert seen == [(H, H, 1), (H, H, 1)] and torch.equal(out, ref)
        seen.clear()
        model.generate(torch.randint(1, 50, (2, 6)), attention_mask=torch.ones(2, 6, dtype=torch.long),
                       max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen and all(s == (H, H, 1) for s in seen), seen  # the prefill's sliced position arrived packed
    assert torch.backends.mkldnn.enabled
