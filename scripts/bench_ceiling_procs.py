"""The linear-layer ceiling of self-distillation for P processes × T threads each, timed at the same moment. Writes JSON.

    python scripts/bench_ceiling_procs.py --processes 2 --threads 1 --rows 128 [--r 0.514] [--out runs/bench/ceiling_2x1.json]

Why: ``bench_distill.py``'s ``ceiling`` times the target's linear layers in one process; a distillation can also
run as several one-thread processes (``torchrun --nproc_per_node P data_prep/distill.py``, one shard each), whose
GEMMs share the cores and memory differently. Each process here loads the target, waits for a common start time
and runs :func:`draftheads.scripts.bench_distill.linear_ceiling`; the host's rates are the sums, and the ceiling
for ``r`` prompt tokens per new token is ``1 / (1/decode + r/prefill)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from draftheads.heads.checkpoint import atomic_write_text
from draftheads.scripts.bench_distill import load_avg

CHILD = """
import json, os, sys, time, torch
torch.set_num_threads(int(os.environ["CEILING_THREADS"]))
from draftheads.heads.target import TargetConfig, load_target
from draftheads.scripts.bench_distill import linear_ceiling
model = load_target(TargetConfig(name=os.environ["CEILING_TARGET"], dtype=os.environ["CEILING_DTYPE"])).model
time.sleep(max(0.0, float(os.environ["CEILING_START"]) - time.time()))
print(json.dumps(linear_ceiling(model, int(os.environ["CEILING_ROWS"]), 0.0, reps=int(os.environ["CEILING_REPS"]))))
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--rows", type=int, default=128, help="decode width: rows of each process's KV cache")
    ap.add_argument("--r", type=float, nargs="+", default=[0.514, 0.21],
                    help="prompt tokens per new token to compute the ceiling for (0.514: a whole-split job)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--load-seconds", type=float, default=30.0, help="time every process gets to load the target")
    ap.add_argument("--out", default="runs/bench/ceiling_procs.json")
    args = ap.parse_args(argv)
    for key in ("processes", "threads", "rows", "reps"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key} must be >= 1, got {getattr(args, key)}")
    env = dict(os.environ, CEILING_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               CEILING_TARGET=args.target, CEILING_DTYPE=args.dtype, CEILING_ROWS=str(args.rows),
               CEILING_REPS=str(args.reps), CEILING_START=str(time.time() + args.load_seconds))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, text=True) for _ in range(args.processes)]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"a timing process failed (exit {p.returncode}):\n{err[-2000:]}")
    per = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    dec = sum(x["decode_linear_tokens_per_s"] for x in per)
    pre = sum(x["prefill_linear_tokens_per_s"] for x in per)
    res = {"processes": args.processes, "threads": args.threads, "rows": args.rows, "target": args.target,
           "decode_linear_tokens_per_s": round(dec, 1), "prefill_linear_tokens_per_s": round(pre, 1),
           "ceiling_new_tokens_per_s": {str(r): round(1.0 / (1.0 / dec + r / pre), 1) for r in args.r},
           "per_process_decode_tokens_per_s": [x["decode_linear_tokens_per_s"] for x in per],
           "load_after": load_avg()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")
