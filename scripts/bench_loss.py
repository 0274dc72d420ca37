"""Time one training step's loss (forward + backward) with the fused loss against the checkpointed chunks. JSON.

    python scripts/bench_loss.py [--family medusa|eagle] [--target smollm2-135m] [--dtype fp32] [--batch 4]
        [--length 512] [--repeats 4] [--out runs/bench/loss.json]

Why: both keep training memory flat in the vocabulary (train/losses.py), but the checkpointed chunks recompute the
[rows, V] logits in backward; through a frozen projection the fused loss takes the gradient with the loss instead.
This runs the family's real objective (Medusa: 4 heads on the shared lm_head; EAGLE: the draft through the
target's lm_head) on random token rows, every position labelled, alternating the two paths ``--repeats`` times
after one warm-up each, so load drift on a shared machine hits both alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from draftheads.heads.checkpoint import atomic_write_text


def _objective(family: str, target: Any) -> tuple[Any, Any]:
    """(objective, the training module whose ``linear_cross_entropy`` selects the fused path)."""
    if family == "medusa":
        import draftheads.train.medusa as mod
        from draftheads.heads.medusa import MedusaHeads, medusa_config_for

        return mod.MedusaObjective(MedusaHeads(medusa_config_for(target, 4, 1, True), target.lm_head()), target), mod
    import draftheads.train.eagle as mod
    from draftheads.heads.eagle import EagleDraft, eagle_config_for

    return mod.EagleObjective(EagleDraft(eagle_config_for(target), target), target, noise="none"), mod


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="medusa", choices=("medusa", "eagle"))
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "auto"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="runs/bench/loss.json")
    a = ap.parse_args(argv)
    if min(a.batch, a.length, a.repeats) < 1 or a.length < 3:
        raise ValueError(f"--batch, --repeats must be >= 1 and --length >= 3, got {a.batch}, {a.repeats}, {a.length}")
    from draftheads.heads.target import load_target

    target = load_target({"name": a.target, "dtype": a.dtype})
    torch.manual_seed(0)
    objective, mod = _objective(a.family, target)
    ids = torch.randint(3, min(target.vocab_size, 49000), (a.batch, a.length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    fused = mod.linear_cross_entropy

    def step(path: str) -> float:
        mod.linear_cross_entropy = fused if path == "fused" else (lambda *x, **k: None)
        objective.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss, _ = objective(batch)
        loss.backward()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"fused": [], "checkpointed": []}
    try:
        for path in times:  # warm-up
            step(path)
        for _ in range(a.repeats):
            for path in times:
                times[path].append(round(step(path), 3))
    finally:
        mod.linear_cross_entropy = fused
    med = {p: statistics.median(t) for p, t in times.items()}
    out = {"command": "python scripts/bench_loss.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "family": a.family, "target": a.target, "dtype": str(target.dtype), "batch": a.batch, "length": a.length,
           "vocab_size": target.vocab_size, "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "seconds_per_step": times, "median_s": med,
           "checkpointed_over_fused": round(med["checkpointed"] / med["fused"], 3)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(out, indent=2) + "\n")
    print(f"{a.family} on {a.target} ({out['dtype']}), batch {a.batch} x {a.length}: fused {med['fused']:.2f} s, "
          f"checkpointed {med['checkpointed']:.2f} s per step ({out['checkpointed_over_fused']}x); wrote {a.out}")
    return out


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(main)
