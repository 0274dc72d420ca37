"""Collect a Hydra sweep into one table and plot: τ, parameter count, training time, throughput.

    python train/medusa.py -m head.num_heads=3,4,5 head.num_layers=1,2 train.eval_after.enabled=true
    python scripts/sweep_report.py runs/sweeps/medusa-smollm2-135m-sharegpt      # (also runs by itself at the end of -m)

Each job directory ``<sweep>/<n>/`` holds ``.hydra/overrides.yaml`` (what the job changed),
``summary.json`` (written by every family's trainer: seconds, tokens/s, launch, parameter count) and,
when ``train.eval_after.enabled``, ``eval.json`` (eval/acceptance.py on the final head: measured τ).
The table shows the knobs that differ between jobs, so the same report serves Medusa (heads, layers),
EAGLE/EAGLE-3 (TTT steps, draft vocabulary, fused layers) or any other override.

Writes ``report.json``, ``report.csv``, ``report.md`` and ``report.png`` into the sweep directory.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

COLUMNS = ["job", "status", "family", "params", "tau", "sim_tau", "eval_tokens_per_s", "train_seconds",
           "train_tokens_per_s", "steps_per_s", "steps", "final_loss", "launch"]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _overrides(job: Path) -> dict[str, str]:
    import yaml

    f = job / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return {}
    out = {}
    for item in yaml.safe_load(f.read_text()) or []:
        k, _, v = str(item).partition("=")
        out[k.lstrip("+~")] = v
    return out


def _param_count(job: Path, summary: dict[str, Any] | None) -> int | None:
    """Trainable parameters from the summary, else counted from the final head's safetensors header."""
    if summary and summary.get("trainable_params"):
        return int(summary["trainable_params"])
    f = job / "final" / "model.safetensors"
    if not f.is_file():
        return None
    from safetensors import safe_open

    n = 0
    with safe_open(str(f), framework="pt") as sf:
        for k in sf.keys():
            n += math.prod(sf.get_slice(k).get_shape())
    return n


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def collect(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """Rows for every job in the sweep plus the list of knobs that vary between jobs."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ValueError(f"sweep directory {sweep_dir} does not exist")
    jobs = job_dirs(sweep_dir)
    if not jobs:
        raise ValueError(f"{sweep_dir} has no job directories (0/, 1/, ...): is it a Hydra sweep dir?")
    ovs = {j.name: _overrides(j) for j in jobs}
    keys = sorted({k for o in ovs.values() for k in o})
    knobs = [k for k in keys if len({o.get(k) for o in ovs.values()}) > 1]
    rows = []
    for j in jobs:
        s = _read_json(j / "summary.json")
        e = _read_json(j / "eval.json")
        last = (s or {}).get("last", {})
        row: dict[str, Any] = {"job": int(j.name), **{k: ovs[j.name].get(k) for k in knobs}}
        row["status"] = "ok" if s and e else ("trained, no eval" if s else "failed or running")
        row["family"] = (s or {}).get("family")
        row["params"] = _param_count(j, s)
        row["tau"] = e["summary"]["tau"] if e else None
        row["sim_tau"] = last.get("sim_tau/tree", last.get("sim_tau/chain"))
        row["eval_tokens_per_s"] = e["summary"]["tokens_per_s"] if e else None
        row["accept_at_depth"] = e["summary"].get("accept_at_depth") if e else None
        row["train_seconds"] = (s or {}).get("seconds")
        row["train_tokens_per_s"] = (s or {}).get("train_tokens_per_s")
        row["steps_per_s"] = (s or {}).get("steps_per_s")
        row["steps"] = (s or {}).get("steps")
        row["final_loss"] = round(last["loss"], 5) if "loss" in last else None
        row["launch"] = ((s or {}).get("launch") or {}).get("mode")
        rows.append(row)
    return {"sweep_dir": str(sweep_dir), "knobs": knobs, "rows": rows}


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, int) and abs(v) >= 1_000_000:
        return f"{v / 1e6:.2f}M"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v / 1e3:.1f}k"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    cols = ["job"] + report["knobs"] + [c for c in COLUMNS if c != "job"]
    head = {"params": "params", "tau": "τ (eval)", "sim_tau": "τ (sim)", "eval_tokens_per_s": "eval tok/s",
            "train_seconds": "train s", "train_tokens_per_s": "train tok/s", "steps_per_s": "steps/s"}
    lines = ["| " + " | ".join(head.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in report["rows"]:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    rows = [r for r in report["rows"] if r.get("tau") is not None or r.get("sim_tau") is not None]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r):
        return ",".join(f"{k.split('.')[-1]}={r.get(k)}" for k in report["knobs"]) or str(r["job"])

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, x, xl in ((axes[0], "params", "trainable parameters"), (axes[1], "train_tokens_per_s", "training tokens/s")):
        for r in rows:
            y = r["tau"] if r.get("tau") is not None else r["sim_tau"]
            if r.get(x) is None:
                continue
            ax.scatter([r[x]], [y], marker="o" if r.get("tau") is not None else "x")
            ax.annotate(label(r), (r[x], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(xl)
        ax.set_ylabel("τ (o: measured, x: simulated)")
    axes[0].set_xscale("log")
    axes[0].set_title("τ vs size")
    axes[1].set_title("τ vs training throughput")
    fig.tight_layout()
    from draftheads.eval.report import save_png

    save_png(fig, path)
    plt.close(fig)
    return True


def write_report(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """Collect and write report.{json,csv,md,png} into the sweep directory (atomically)."""
    from draftheads.heads.checkpoint import atomic_write_text

    sweep_dir = Path(sweep_dir)
    report = collect(sweep_dir)
    atomic_write_text(sweep_dir / "report.json", json.dumps(report, indent=2))
    buf = io.StringIO()
    cols = ["job"] + report["knobs"] + [c for c in COLUMNS if c != "job"]
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(report["rows"])
    atomic_write_text(sweep_dir / "report.csv", buf.getvalue())
    atomic_write_text(sweep_dir / "report.md", markdown(report))
    report["plot"] = plot(report, sweep_dir / "report.png")
    return report


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[misc,assignment]


class SweepReportCallback(Callback):
    """Hydra callback: after a ``-m`` sweep, rank 0 writes the report into the sweep directory."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        try:
            r = write_report(config.hydra.sweep.dir)
            print(markdown(r))
            print(f"sweep report: {Path(config.hydra.sweep.dir) / 'report.md'}")
        except ValueError as e:  # an empty or foreign sweep dir: say so, never fail the sweep
            log.warning("no sweep report: %s", e)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", help="Hydra sweep dir, e.g. runs/sweeps/medusa-smollm2-135m-sharegpt")
    a = ap.parse_args(argv)
    r = write_report(a.sweep_dir)
    print(markdown(r))
    print(f"wrote {Path(a.sweep_dir) / 'report.md'} (+ .json, .csv{', .png' if r['plot'] else ''})")
    return r


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(main)
