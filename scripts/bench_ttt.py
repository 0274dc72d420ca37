"""Benchmark training-time-test attention memory: block form (heads.eagle3_ttt.ttt_attention) vs the dense
(k·T)-wide reference mask, over TTT steps k and sequence lengths T. Writes JSON.

    python scripts/bench_ttt.py [--T 256 512 1024] [--k 1 3 7] [--batch 1] [--out runs/bench/ttt.json]

One forward + backward of ``Eagle3Draft.rollout`` (loss = mean of squared outputs, so the number isolates
the rollout; the lm_head is the same in both modes) with SmolLM2-135M's layer shapes (H 576, 9 heads,
3 KV heads, MLP 1536, bf16 autocast off: fp32) on a random target skeleton — no download, no data.
Peak memory: on CUDA ``max_memory_allocated`` minus the allocation before the step; on CPU the process's
peak RSS (VmHWM, reset through /proc/self/clear_refs before each run) minus the RSS before the step, with
glibc's mmap threshold pinned (MALLOC_MMAP_THRESHOLD_, set by re-executing) so that freed tensors leave the
RSS instead of staying in the heap — otherwise later runs reuse earlier runs' memory and read as ~0.
``attn_bytes_saved`` is the analytic size of the attention probabilities kept for backward:
block Σ_s B·nh·T·(T+s), dense Σ_s B·nh·T·(s+1)·T (fp32).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from draftheads.heads import job  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for  # noqa: E402
from draftheads.heads.target import from_model  # noqa: E402


def _rss_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def skeleton(device: str):
    """A 4-layer random Llama with SmolLM2-135M's widths (the draft only borrows classes, embedding, shapes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return from_model(LlamaForCausalLM(cfg).to(device).eval())


def run_one(draft: Eagle3Draft, B: int, T: int, k: int, dense: bool, device: str) -> dict:
    H = draft.config.hidden_size
    nh = draft.layer_config.num_attention_heads
    g = torch.Generator(device="cpu").manual_seed(T * 31 + k)
    aux = torch.randn(B, T, 3 * H, generator=g).to(device)
    tokens = torch.randint(0, 49152, (B, T + k - 1), generator=g).to(device)
    pos = torch.arange(T, device=device)[None].expand(B, T)
    step0 = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None].expand(B, T, T)
    draft.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mb("VmRSS")
        _reset_peak()
    t0 = time.perf_counter()
    outs = draft.rollout(aux, tokens, pos, step0, k, dense=dense)
    loss = sum(o.float().pow(2).mean() for o in outs)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        peak = _rss_mb("VmHWM") - base
    secs = time.perf_counter() - t0
    attn = sum(B * nh * T * ((T + s) if not dense else (s + 1) * T) * 4 for s in range(k))
    del outs, loss
    return {"T": T, "k": k, "batch": B, "mode": "dense" if dense else "block", "peak_mb": round(peak, 1),
            "seconds": round(secs, 3), "attn_bytes_saved_mb": round(attn / 2 ** 20, 1)}


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and not torch.cuda.is_available():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-dense-above", type=int, default=1 << 30, help="skip dense runs with T·k above this")
    ap.add_argument("--out", default="runs/bench/ttt.json")
    args = ap.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    tgt = skeleton(device)
    draft = Eagle3Draft(eagle3_config_for(tgt, [1, 2, 3], 32000), tgt, vocab_ids=range(32000)).to(device)
    run_one(draft, 1, 64, 2, False, device)  # warm-up: allocator, kernels
    rows = []
    for T in sorted(args.T):
        for k in sorted(args.k):
            for dense in (False, True):
                if dense and T * k > args.skip_dense_above:
                    continue
                r = run_one(draft, args.batch, T, k, dense, device)
                print(json.dumps(r), flush=True)
                rows.append(r)
    out = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "shapes": {"hidden": 576, "heads": 9, "kv_heads": 3, "draft_vocab": 32000}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    job.cli(main)
