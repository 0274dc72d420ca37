"""Benchmark the attention kernel for batched generation (the distill job's inner loop). Writes JSON.

    python scripts/bench_decode_attn.py [--dtype auto] [--batch 32] [--new 64] [--out runs/bench/decode_attn.json]

Why: on a CPU, torch's SDPA kernel and eager attention trade places by shape. On a 2-core AVX512-BF16 EPYC in
bf16, one [32 x 1] decoding step over a 300-token cache took 673 ms with SDPA and 334 ms eager, while the
[32 x T] prompt forward favours SDPA. Which wins for a whole distillation depends on the prompt and answer
lengths, so this times the distill job's own ``generate_batch`` on the first ``--batch`` ShareGPT first turns
(the embedded data; greedy, ``--new`` tokens each) with both kernels; pick one for the job with
``target.attn_implementation=eager|sdpa`` (the target's default is SDPA). Speed only: the two kernels round
differently in bf16, so their answers may differ in a few tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]

from draftheads.data_prep.distill import generate_batch  # noqa: E402
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--out", default="runs/bench/decode_attn.json")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
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
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_path, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    job.cli(main)
