"""Benchmark the attention kernel for batched generation (the distill job's inner loop). Writes JSON.

    python scripts/bench_decode_attn.py [--dtype auto] [--batch 32] [--new 64] [--out runs/bench/decode_attn.json]

Why: on a CPU, torch's SDPA kernel and eager attention trade places by shape. On a 2-core AVX512-BF16 EPYC in
bf16, one [32 x 1] decoding step over a 300-token cache took 673 ms with SDPA and 334 ms eager, while the
[32 x T] prompt forward favours SDPA. Which wins for a whole distillation depends on the prompt and answer
lengths, so this times the distill job's own ``generate_batch`` on the first ``--batch`` ShareGPT first turns
(the embedded data; greedy, ``--new`` tokens each) with both kernels; pick one for the job with
``target.attn_implementation=eager|sdpa`` (the target's default is SDPA). Speed only: the two kernels round
differently in bf16, so their answers may differ in a few tokens.

``--kernel`` times instead one decode step's attention alone in the slot engine (``data_prep/fastgen.py``, which
distill uses): ``--rows`` rows attending over ``--keys`` cached keys in each of ``--layers`` layers (each layer its
own cache, as in the engine, so nothing stays in the L3), with the engine's own ``_attend`` (two matmuls, fp32
softmax) and its SDPA path (``decode_attention=sdpa``, over the query heads with ``enable_gqa``), ``q·Kᵀ`` alone, and merely reading every K and V once
(a max over the bytes): the last is the floor any kernel on this host pays for an unquantized cache. Defaults are SmolLM2-135M's
shapes and the recipe job's average step (~128 rows, 320 keys).

    python scripts/bench_decode_attn.py --kernel [--rows 128 --keys 320] [--out runs/bench/decode_attn_kernel.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]

from draftheads.data_prep.distill_engines import generate_batch  # noqa: E402
from draftheads.data_prep.fastgen import SlotDecoder  # noqa: E402
from draftheads.data_prep.sources import load_conversations  # noqa: E402
from draftheads.data_prep.template import ensure_chat_template, prompt_ids  # noqa: E402
from draftheads.heads import job  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.target import TargetConfig, dtype_name, load_target, parse_dtype, resolve_device  # noqa: E402


def first_turn_prompts(tokenizer, n: int, max_tokens: int) -> list[list[int]]:
    """Token ids of the first ``n`` embedded ShareGPT first turns no longer than ``max_tokens``."""
    convs, _ = load_conversations("sharegpt", None, 4 * n + 100)
    out = []
    for c in convs:
        user = next((m["content"] for m in c.messages if m["role"] == "user"), None)
        if user:
            ids = prompt_ids(tokenizer, [{"role": "user", "content": user}])
            if len(ids) <= max_tokens:
                out.append(ids)
        if len(out) == n:
            break
    return out


def median_seconds(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` after one warm-up call (unrounded: tiny shapes take microseconds)."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _median_ms(fn, reps: int) -> float:
    return round(1000 * median_seconds(fn, reps), 2)


def kernel(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    """One decode step's attention over ``args.layers`` separate caches, four ways (see the module docstring)."""
    n, kvh, g, S, D, L = args.rows, args.kv_heads, args.group, args.keys, args.head_dim, args.layers
    torch.manual_seed(0)
    K = [torch.randn(n, kvh, S, D, dtype=dtype) for _ in range(L)]  # [n, KVH, S, D] per layer
    V = [torch.randn(n, kvh, S, D, dtype=dtype) for _ in range(L)]
    q = torch.randn(n, kvh, g, D, dtype=dtype)  # [n, KVH, G, D]: each KV head's query group
    bias = torch.zeros(n, 1, 1, S)  # [n, 1, 1, S] additive mask, every key live
    eng = SimpleNamespace(scale=D ** -0.5, attention="matmul")  # the engine's own _attend, either kernel
    sdpa = SimpleNamespace(scale=D ** -0.5, attention="sdpa")
    mask = bias.to(dtype)  # SDPA's mask in the model's dtype, as SlotDecoder._plan makes it
    variants = {
        "engine_matmuls": lambda: [SlotDecoder._attend(eng, q, K[i], V[i], bias) for i in range(L)],
        "sdpa_enable_gqa": lambda: [SlotDecoder._attend(sdpa, q, K[i], V[i], mask) for i in range(L)],
        "qk_only": lambda: [torch.matmul(q, K[i].transpose(-1, -2)) for i in range(L)],
        # the cheapest full read found: a max over the bytes viewed as int32 (on an AMX Xeon 44 ms for 900 MiB,
        # against 58 ms for a bf16 sum and 113 ms for a sum accumulated in fp32, which are compute-bound)
        "read_every_kv_once": lambda: [(K[i].view(torch.int32).amax(), V[i].view(torch.int32).amax()) for i in range(L)],
    }
    # the timed kernels compute the same thing: SDPA against the engine on layer 0 (fp32 softmax vs SDPA's)
    ref = SlotDecoder._attend(eng, q, K[0], V[0], bias).float()
    got = SlotDecoder._attend(sdpa, q, K[0], V[0], mask).float()
    ms = {}
    for name, fn in variants.items():
        ms[name] = _median_ms(fn, args.reps)
        print(f"{name}: {ms[name]} ms", flush=True)
    kv_bytes = 2 * L * K[0].numel() * K[0].element_size()
    return {"mode": "kernel", "dtype": dtype_name(dtype), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "rows": n, "kv_heads": kvh, "group": g, "keys": S, "head_dim": D, "layers": L, "reps": args.reps,
            "ms_per_step": ms, "kv_mib": round(kv_bytes / 2**20, 1),
            "read_gb_per_s": round(kv_bytes / (ms["read_every_kv_once"] / 1000) / 1e9, 1),
            "engine_over_floor": round(ms["engine_matmuls"] / ms["read_every_kv_once"], 2),
            "sdpa_vs_engine_max_abs_diff": float((ref - got).abs().max())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--out", default=None, help="JSON path (default runs/bench/decode_attn[_kernel].json)")
    ap.add_argument("--kernel", action="store_true", help="time the slot engine's decode attention alone (CPU)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--keys", type=int, default=320)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    for k in ("batch", "new", "rows", "keys", "kv_heads", "group", "head_dim", "layers", "reps"):
        if getattr(args, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    if args.kernel:
        result = kernel(args, dtype)
        _write(Path(args.out or "runs/bench/decode_attn_kernel.json"), result)
        return result
    gen_cfg = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=args.new)
    result: dict = {"device": str(device), "dtype": dtype_name(dtype), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "batch": args.batch, "new_tokens": args.new,
                    "tokens_per_s": {}}
    if device.type == "cpu":
        result["cpu"] = getattr(torch.cpu, "get_capabilities", lambda: {})().get("cpu_name")
    prompts = None
    for impl in ("sdpa", "eager"):
        target = load_target(TargetConfig(dtype=dtype_name(dtype), attn_implementation=impl), device)
        ensure_chat_template(target.tokenizer, None)
        prompts = prompts or first_turn_prompts(target.tokenizer, args.batch, args.max_prompt_tokens)
        generate_batch(target, prompts[:2], SimpleNamespace(**{**vars(gen_cfg), "max_new_tokens": 2}), 0)  # warm-up
        t = time.perf_counter()
        out = generate_batch(target, prompts, gen_cfg, 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t
        result["tokens_per_s"][impl] = round(sum(len(ids) for ids, _ in out) / dt, 1)
        print(f"{impl}: {result['tokens_per_s'][impl]} new tokens/s", flush=True)
    tps = result["tokens_per_s"]
    result["eager_speedup"] = round(tps["eager"] / tps["sdpa"], 3)
    result["faster"] = max(tps, key=tps.get)
    _write(Path(args.out or "runs/bench/decode_attn.json"), result)
    return result


def _write(out_path: Path, result: dict) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_path, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    job.cli(main)
