"""Benchmark the trainer's CPU step time under memory-allocator settings. Writes JSON.

    python scripts/bench_allocator.py [--settings system,keep,thp] [--steps 25] [--skip 5] [--rounds 1]
                                      [--out runs/bench/allocator.json] [-- <train/eagle3.py overrides>]

Why: on CPU, torch takes every tensor above glibc's mmap threshold (at most 32 MiB) straight from the kernel and
hands it back on free, so the next step's tensors of the same size are page-faulted and zeroed again. An EAGLE-3
step holds several vocabulary-sized logits tensors ([B, T, V] fp32, hundreds of MB each); a training run was seen
spending about a fifth of its CPU time in the kernel at ~150k minor faults per second. Each setting runs the same
trainer command in a fresh process (the settings are read at process start), one after the other, so the ratio
between them is measured in one time window:

- ``system``: ``DRAFTHEADS_MALLOC=system``: glibc's and torch's defaults (what draftheads did before heads/malloc.py).
- ``keep``: nothing set: draftheads' entry points tell glibc to serve large blocks from its heap and keep freed
  memory (``heads/malloc.py``), so the next step reuses it without faults, at the cost of a higher resident size.
- ``thp``: glibc's defaults plus ``THP_MEM_ALLOC_ENABLE=1``: torch aligns tensors of 2 MiB and more to huge pages
  and asks the kernel for them (``madvise``), 512x fewer faults for the same bytes (each page is still zeroed).

Per setting: steady seconds per step (metrics.jsonl rows after ``--skip`` steps), minor faults, user and system
CPU seconds of the trainer process (``getrusage`` of children), its peak RSS (the run's summary.json), and the load
average around it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.malloc import glibc_malloc_vars  # noqa: E402

SETTINGS: dict[str, dict[str, str]] = {
    "system": {"DRAFTHEADS_MALLOC": "system"},
    "keep": {},
    "thp": {"DRAFTHEADS_MALLOC": "system", "THP_MEM_ALLOC_ENABLE": "1"},
}
BASELINE = "system"
# a short run of the recipe's EAGLE-3 training step (fresh head: no τ measurement at start)
DEFAULT_OVERRIDES = ["+experiment=eagle3_full", "head.ttt_steps=4", "head.draft_vocab_size=8192",
                     "head.draft_vocab_reference=sharegpt", "train.tau_eval.every=0",
                     "train.save_every=0", "train.eval_every=0", "train.log_every=1", "logging.wandb=disabled"]


def steady_seconds_per_step(metrics: Path, skip: int) -> float | None:
    """Mean wall seconds per step after ``skip`` steps, from the loop's cumulative steps_per_s."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("steps_per_s")]
    elapsed = [(r["step"], r["step"] / r["steps_per_s"]) for r in rows]  # fresh run: start step 0
    after = [e for e in elapsed if e[0] >= skip]
    if len(after) < 2:
        return None
    (s0, t0), (s1, t1) = after[0], after[-1]
    return (t1 - t0) / (s1 - s0)


def run_setting(name: str, steps: int, skip: int, overrides: list[str], work: Path) -> dict:
    """Run the trainer once under one setting; its figures."""
    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)
    drop = {k for s in SETTINGS.values() for k in s} | set(glibc_malloc_vars(os.environ))
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(SETTINGS[name], WANDB_MODE="disabled")
    cmd = [sys.executable, str(REPO / "train" / "eagle3.py"), *overrides, f"train.max_steps={steps}",
           f"out_dir={out_dir}", "train.resume=false"]
    load0, t0 = os.getloadavg(), time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the trainer is our only child in this window
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise SystemExit(f"error: {name}: the trainer exited {proc.returncode}: {tail}")
    summary = json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").is_file() else {}
    return {"setting": name, "env": SETTINGS[name], "wall_s": round(wall, 1),
            "seconds_per_step": round(steady_seconds_per_step(out_dir / "metrics.jsonl", skip) or float("nan"), 3),
            "minor_faults": after.ru_minflt - before.ru_minflt,
            "user_s": round(after.ru_utime - before.ru_utime, 1), "sys_s": round(after.ru_stime - before.ru_stime, 1),
            "peak_rss_mb": summary.get("peak_rss_mb"),
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="system,keep,thp", help=f"comma-separated, from {list(SETTINGS)}")
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the steady figure (warm-up)")
    ap.add_argument("--rounds", type=int, default=1, help="run the settings in turn this many times")
    ap.add_argument("--out", default="runs/bench/allocator.json")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.settings.split(",") if n.strip()]
    bad = [n for n in names if n not in SETTINGS]
    if bad:
        raise SystemExit(f"error: --settings: unknown {bad}; allowed: {list(SETTINGS)}")
    if a.steps < a.skip + 2:
        raise SystemExit(f"error: --steps {a.steps} must be at least --skip + 2 = {a.skip + 2}")
    overrides = DEFAULT_OVERRIDES + extra
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_alloc_") as work:
        for r in range(a.rounds):
            for n in names:
                res = run_setting(n, a.steps, a.skip, overrides, Path(work))
                res["round"] = r
                runs.append(res)
                print(json.dumps(res), flush=True)
    base = [x["seconds_per_step"] for x in runs if x["setting"] == BASELINE]
    out = {"overrides": overrides, "steps": a.steps, "skip": a.skip, "threads": os.environ.get("OMP_NUM_THREADS"),
           "cpus": os.cpu_count(), "runs": runs}
    if base:
        ref = sum(base) / len(base)
        out[f"speedup_vs_{BASELINE}"] = {n: round(ref / (sum(v) / len(v)), 3) for n in names
                                     if (v := [x["seconds_per_step"] for x in runs if x["setting"] == n])}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}: {out.get(f'speedup_vs_{BASELINE}')}")
    return out


if __name__ == "__main__":
    main()
