"""One PNG for heads measured in separate runs: τ by category and P(accepted ≥ d) side by side (prints JSON).

Why: ``eval/measure.py`` plots the heads it measured together; heads trained at different budgets or sessions
are measured in separate runs (README's 200- vs 450-step tables), and this puts them in one figure from the
runs' ``results.json`` rows, with the same τ and depth definitions as measure (eval/tau.py, depth_stats).

    python scripts/plot_runs.py out=runs/cmp4/families.png runs/cmp4/measure2-medusa:medusa@"Medusa 450" \
        runs/cmp4/measure2-eagle:eagle@"EAGLE 450" [setting=greedy] [turn=N]

Each head is ``RUN:METHOD[@LABEL]`` (RUN: a measure directory or its results.json). The overall bar carries a
95% bootstrap interval over questions (the turns of a question resampled together).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from draftheads.heads import job  # noqa: E402
from draftheads.eval.measure_summary import depth_stats  # noqa: E402
from draftheads.eval.report import save_png  # noqa: E402
from draftheads.eval.tau import tau  # noqa: E402
from draftheads.scripts.paired_tau import load_rows  # noqa: E402


def head_summary(rows: list[dict[str, Any]], boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """τ overall (with a question-level bootstrap interval), τ per category, and P(accepted ≥ d)."""
    by_q: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        by_q.setdefault(r["question_id"], []).append(r)
    groups = list(by_q.values())
    rng = np.random.default_rng(seed)
    draws = [tau([r for i in rng.integers(0, len(groups), len(groups)) for r in groups[i]]) for _ in range(boot)]
    cats = sorted({r.get("category") or "all" for r in rows})
    return {"tau": round(tau(rows), 4), "ci95": [round(float(np.percentile(draws, q)), 4) for q in (2.5, 97.5)],
            "turns": len(rows), "questions": len(groups),
            "per_category": {c: round(tau([r for r in rows if (r.get("category") or "all") == c]), 4) for c in cats},
            "accept_at_depth": depth_stats(rows)["accept_at_depth"]}


def plot(heads: dict[str, dict[str, Any]], out: Path, title: str) -> None:
    """Grouped τ bars by category (+ overall with its interval) and acceptance-by-depth lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = sorted({c for h in heads.values() for c in h["per_category"]})
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.1 * (len(cats) + 1) + 5), 4.2),
                             gridspec_kw={"width_ratios": [2.2, 1]})
    x = np.arange(len(cats) + 1)
    w = 0.8 / len(heads)
    for i, (label, h) in enumerate(heads.items()):
        vals = [h["per_category"].get(c, np.nan) for c in cats] + [h["tau"]]
        xs = x + i * w - 0.4 + w / 2
        axes[0].bar(xs, vals, w, label=label)
        lo, hi = h["ci95"]
        axes[0].errorbar(xs[-1], h["tau"], yerr=[[h["tau"] - lo], [hi - h["tau"]]], color="k", capsize=3, lw=1)
        d = h["accept_at_depth"]
        axes[1].plot(np.arange(1, len(d) + 1), d, marker="o", label=label)
    axes[0].axhline(1.0, color="k", lw=0.8)
    top = max(max(h["ci95"][1], *h["per_category"].values()) for h in heads.values())
    axes[0].set_ylim(0.9, top + 0.08 * (1 + (len(heads) + 2) // 3))  # headroom for the legend
    axes[0].set_xticks(x, cats + ["overall"], rotation=30, ha="right")
    axes[0].set_ylabel("τ (tokens per target forward)")
    axes[0].legend(fontsize=8, ncol=min(3, len(heads)), loc="upper left")
    axes[0].set_title(title)
    axes[1].set_xlabel("tree depth d")
    axes[1].set_title("P(accepted ≥ d)")
    axes[1].set_ylim(0, 1.02)
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, out)
    plt.close(fig)


def main(argv: list[str]) -> int:
    keys = ("out=", "setting=", "turn=")
    opts = dict(a.split("=", 1) for a in argv if a.startswith(keys))
    specs = [a for a in argv if not a.startswith(keys)]  # RUN:METHOD[@LABEL]; load_rows names a malformed one
    if not specs or "out" not in opts:
        print(__doc__)
        return 2
    setting, turn = opts.get("setting", "greedy"), opts.get("turn")
    heads: dict[str, dict[str, Any]] = {}
    try:
        for spec in specs:
            run_method, _, label = spec.partition("@")
            name, rows = load_rows(run_method)
            keep = [r for k, r in rows.items() if k[0] == setting and (turn is None or k[2] == int(turn))]
            if not keep:
                raise ValueError(f"{run_method}: no rows for setting={setting!r}" + (f", turn={turn}" if turn else ""))
            heads[label or name] = head_summary(keep)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(opts["out"])
    plot(heads, out, f"τ by category ({setting}" + (f", turn {turn})" if turn else ")"))
    print(json.dumps({"png": str(out), "heads": heads}, indent=1))
    return 0


if __name__ == "__main__":
    job.cli(main, sys.argv[1:])
