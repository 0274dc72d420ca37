"""Benchmark the Medusa spine on the embedded default and write JSON:
data-prep records/s, training tokens/s and peak memory (RSS), per configuration.

    python scripts/bench_medusa.py [--steps 8] [--out runs/bench/medusa.json]

Numbers depend on the machine and on what else runs; rerun before relying on one.
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


def bench_prepare(max_conversations: int) -> dict:
    from transformers import AutoTokenizer

    from draftheads.data_prep.dataset import DataConfig, prepare_data
    from draftheads.heads.target import TargetConfig
    from draftheads.heads.target_source import resolve_target

    path, _ = resolve_target(TargetConfig())
    tok = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory() as d:
        cfg = DataConfig(max_conversations=max_conversations, max_length=1024, cache_dir=d)
        t0 = time.perf_counter()
        data = prepare_data(cfg, tok)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        prepare_data(cfg, tok)
        warm = time.perf_counter() - t0
    s = data.stats
    return {"conversations_read": s["load"]["read"], "examples": s["rows"]["train"] + s["rows"]["heldout"],
            "tokens": s["train"]["tokens"] + s["heldout"]["tokens"], "seconds_cold": round(cold, 2),
            "records_per_s": round(s["load"]["read"] / cold, 1), "tokens_per_s": round(
                (s["train"]["tokens"] + s["heldout"]["tokens"]) / cold, 1), "seconds_cached": round(warm, 3)}


def bench_train(steps: int, batch: int, share: bool, max_length: int) -> dict:
    """Run the real entry in a subprocess so peak RSS is the training job's own."""
    out = Path(tempfile.mkdtemp(prefix="bench-medusa-"))
    code = f"""
import json, resource, sys
sys.argv = ['x']
from hydra import compose, initialize_config_dir
from draftheads.train.medusa import main
with initialize_config_dir(config_dir={str(REPO / 'conf')!r}, version_base=None):
    cfg = compose('medusa', ['data=sharegpt_small', 'data.max_length={max_length}', 'out_dir={out}',
                             'logging.wandb=disabled', 'train.max_steps={steps}', 'train.batch_size={batch}',
                             'train.save_every=0', 'train.log_every=1', 'train.eval_tokens=0',
                             'head.share_lm_head={str(share).lower()}'])
s = main(cfg)
print('BENCH', json.dumps({{'tokens_per_s': s['train_tokens_per_s'], 'seconds': s['seconds'],
      'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    line = next((l for l in p.stdout.splitlines() if l.startswith("BENCH ")), None)
    if line is None:
        raise RuntimeError(f"training benchmark failed:\n{p.stderr[-3000:]}")
    r = json.loads(line[6:])
    r.update({"steps": steps, "batch_size": batch, "max_length": max_length, "share_lm_head": share})
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--out", default="runs/bench/medusa.json")
    a = ap.parse_args()
    import torch

    res = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "cuda": torch.cuda.is_available()},
           "prepare": bench_prepare(a.conversations),
           "train": [bench_train(a.steps, 4, share, 512) for share in (True, False)]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(main)
