"""Benchmark bf16 vs fp32 on this host, and show what ``auto`` precision picks. Writes JSON.

    python scripts/bench_dtype.py [--device cpu] [--tokens 512] [--target] [--out runs/bench/dtype.json]

Why: bf16 is ~6x faster than fp32 on CPUs with AMX (and fast with AVX512-BF16), but CPUs with only AVX2
(many AMD EPYC hosts) emulate it and run it tens of times *slower* than fp32. ``target.dtype=auto`` and
``train.mixed_precision=auto`` (the defaults) follow :func:`heads.target.bf16_is_fast`; this script
measures whether that choice is right here. Two measurements per dtype, each the best of a few repeats:
a [tokens, 576] x [576, 1536] matmul (SmolLM2-135M's MLP shape) in GFLOP/s, and, with ``--target``, a
forward of the embedded SmolLM2-135M over one ``tokens``-long sequence in tokens/s (loads from the
local cache; no download).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from draftheads.heads import job  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.target import TargetConfig, bf16_is_fast, dtype_name, load_target, parse_dtype  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (kernel selection, allocation)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_gflops(dtype: torch.dtype, device: str, tokens: int, repeats: int) -> float:
    a = torch.randn(tokens, 576, device=device, dtype=dtype)  # [T, H]
    b = torch.randn(576, 1536, device=device, dtype=dtype)  # [H, I]
    return 2 * tokens * 576 * 1536 / best_seconds(lambda: a @ b, repeats) / 1e9


@torch.no_grad()
def target_tokens_per_s(dtype: torch.dtype, device: str, tokens: int, repeats: int) -> float:
    target = load_target(TargetConfig(dtype=dtype_name(dtype)), device)
    ids = torch.randint(0, target.vocab_size, (1, tokens), device=device)  # [1, T]
    return tokens / best_seconds(lambda: target.model(input_ids=ids), repeats)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", action="store_true", help="also time a SmolLM2-135M forward per dtype")
    ap.add_argument("--out", default="runs/bench/dtype.json")
    args = ap.parse_args(argv)
    result: dict = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "bf16_is_fast": bf16_is_fast(args.device),
                    "auto_picks": dtype_name(parse_dtype("auto", args.device)), "matmul_gflops": {}}
    if args.device == "cpu":
        caps = getattr(torch.cpu, "get_capabilities", lambda: {})()
        result["cpu"] = {k: caps.get(k) for k in ("cpu_name", "avx2", "avx512_f", "avx512_bf16", "amx_bf16")}
    for dt in DTYPES:
        result["matmul_gflops"][dtype_name(dt)] = round(matmul_gflops(dt, args.device, args.tokens, args.repeats), 2)
    if args.target:
        result["target_tokens_per_s"] = {dtype_name(dt): round(target_tokens_per_s(dt, args.device, args.tokens,
                                                                                  args.repeats), 1) for dt in DTYPES}
    g = result["matmul_gflops"]
    result["bf16_speedup"] = round(g["bf16"] / g["fp32"], 4)
    faster = "bf16" if g["bf16"] > g["fp32"] else "fp32"
    result["auto_is_faster_choice"] = result["auto_picks"] == faster
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    job.cli(main)
