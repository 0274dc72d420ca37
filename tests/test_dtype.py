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
    ratio = res["matmul_gflops"]["bf16"] / res["matmul_gflops"]["fp32"]  # of the rounded GFLOP/s figures
    assert res["bf16_speedup"] == pytest.approx(ratio, rel=1e-2, abs=1e-3)
