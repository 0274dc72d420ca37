"""Draw a run's ``training.png`` again from its ``metrics.jsonl`` (the trainer draws it when it ends; a run that
was stopped, or one still going, has none or an old one).

    python scripts/plot_run.py runs/<run> [--out FILE.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]

from draftheads.heads import job  # noqa: E402
from draftheads.train.reporting import ReportMixin  # noqa: E402


def plot_run(run: Path, out: Path | None = None) -> Path:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: give a training run's output directory")
    history = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    if not any("loss" in r for r in history):
        raise ValueError(f"{metrics} has no training rows (no 'loss')")
    best = run / "best" / "best.json"
    tau_best = json.loads(best.read_text()) if best.is_file() else None
    ReportMixin._plot(SimpleNamespace(history=history, tau_best=tau_best, out_dir=run))  # writes run/training.png
    if out is not None and out.resolve() != (run / "training.png").resolve():
        shutil.copyfile(run / "training.png", out)
        return out
    return run / "training.png"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a training run's output directory (holds metrics.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="also copy the PNG here")
    a = ap.parse_args(argv)
    print(plot_run(a.run, a.out))


if __name__ == "__main__":
    job.cli(main)
