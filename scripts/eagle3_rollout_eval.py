"""Held-out metrics of a trained EAGLE-3 checkpoint under a k-step rollout (not a test; prints and writes JSON).

Why: a draft trained with ``head.ttt_steps=1`` only ever reports step-0 accuracy during training; to compare it
with a ttt_steps=7 draft (the training-time-test ablation) both must be scored on the same held-out tokens with
the same rollout depth. This rebuilds the EAGLE-3 trainer's objective around the checkpoint (its draft vocabulary
and architecture, never recounted) and runs the trainer's own held-out evaluation: per-step CE and top-1
agreement with the target (s0 … s{k-1}) and the simulated τ.

    python scripts/eagle3_rollout_eval.py runs/exp/eagle3-d1/final data=distilled rollout=7 [out=x.json]

Extra arguments are Hydra overrides of ``conf/eagle3.yaml`` (the data the checkpoint was trained on, so that the
held-out split is the same; ``train.eval_tokens`` for the budget).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir  # noqa: E402

from draftheads.heads import job  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.train.eagle3 import build  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def evaluate(checkpoint: str, rollout: int, overrides: list[str]) -> dict:
    """The trainer's held-out metrics for ``checkpoint`` with ``rollout`` TTT steps (no training step taken)."""
    if not (Path(checkpoint) / "config.json").is_file():
        raise ValueError(f"{checkpoint} is not a head checkpoint directory (no config.json)")
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("eagle3", overrides=[f"head.init_from={checkpoint}", f"head.ttt_steps={rollout}",
                                           "head.draft_vocab_size=null", "head.aux_layers=null",
                                           "logging.wandb=disabled", "train.resume=false", f"out_dir={tmp}",
                                           *overrides])
        b = build(cfg)
        metrics = b["trainer"]._eval_metrics()
    return {"checkpoint": checkpoint, "rollout": rollout, "overrides": overrides,
            "metrics": {k: round(float(v), 5) for k, v in metrics.items()}}


def main(argv: list[str]) -> None:
    if not argv or "=" in argv[0]:
        raise SystemExit(__doc__)
    ckpt, rest = argv[0], argv[1:]
    rollout = int(next((a.split("=", 1)[1] for a in rest if a.startswith("rollout=")), 7))
    out = next((a.split("=", 1)[1] for a in rest if a.startswith("out=")), None)
    overrides = [a for a in rest if not a.startswith(("rollout=", "out="))]
    res = evaluate(ckpt, rollout, overrides)
    text = json.dumps(res, indent=2)
    print(text)
    if out:
        atomic_write_text(Path(out), text + "\n")


if __name__ == "__main__":
    job.cli(main, sys.argv[1:])
