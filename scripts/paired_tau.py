"""Is one draft's τ lead over another more than prompt noise? A paired bootstrap over prompts (prints JSON).

Why: see eval/tau.py. ``eval/measure.py`` reports the same comparison for every pair of heads it measured
together; this script pairs heads from two separate runs (measure runs or eval/acceptance.py results).

    python scripts/paired_tau.py runs/measure/A:eagle runs/measure/B:eagle3 [boot=10000] [seed=0] \
        [cluster=question|turn] [turn=N]
    python scripts/paired_tau.py runs/a/eval.json runs/b/eval.json

Each argument is ``RUN:METHOD``: a directory written by ``eval/measure.py`` (or its ``results.json``) and a
method name in it; or an ``eval/acceptance.py`` result file (its ``out=``), e.g. two heads' fp32 runs. Rows are
paired by (setting, question_id, turn); both sides must emit the same number of tokens per row (true for greedy
runs of the same target, which are token-identical).

``cluster=question`` (default) resamples whole questions, so a multi-turn run's turns of one question move
together; ``cluster=turn`` treats every turn as an independent draw (narrower, and optimistic when turns of a
question are alike). With one turn per question the two are the same. ``turn=N`` keeps only turn N (0 = first).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from draftheads.heads import job  # noqa: E402
from draftheads.eval.tau import paired_forwards  # noqa: E402


def load_rows(spec: str) -> tuple[str, dict[tuple, dict[str, Any]]]:
    """``RUN:METHOD`` (an eval/measure.py run) or ``FILE.json`` (an eval/acceptance.py result) -> (label,
    {(setting, question_id, turn): row}). An acceptance result's rows carry each step's accepted count, from which
    its forwards and accepted tokens follow; its setting is its mode ("greedy"), so it pairs with a measure run's."""
    path = Path(spec)
    if ":" not in spec and path.is_file():
        data = json.loads(path.read_text())
        if "summary" not in data or not all("accepted" in r for r in data.get("rows", [None])):
            raise ValueError(f"{spec}: not an eval/acceptance.py result (no summary or per-step 'accepted' rows); "
                             f"for an eval/measure.py run give RUN:METHOD")
        setting = data.get("mode")
        return path.stem, {(setting, r["question_id"], r.get("turn", 0)):
                           {**r, "steps": len(r["accepted"]), "accepted_total": sum(r["accepted"])}
                           for r in data["rows"]}
    if ":" not in spec:
        raise ValueError(f"expected RUN:METHOD (e.g. runs/measure/x:eagle) or an eval/acceptance.py result file, "
                         f"got {spec!r}")
    run, method = spec.rsplit(":", 1)
    path = Path(run)
    path = path / "results.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{run}: no results.json (write one with eval/measure.py)")
    rows = json.loads(path.read_text()).get("rows", [])
    mine = {(r.get("setting"), r["question_id"], r.get("turn", 0)): r for r in rows if r["method"] == method}
    if not mine:
        methods = sorted({r["method"] for r in rows})
        raise ValueError(f"{path}: no rows for method {method!r}; it has {methods}")
    return f"{path.parent.name}:{method}", mine


def compare(spec_a: str, spec_b: str, boot: int = 10000, seed: int = 0, cluster: str = "question",
            turn: int | None = None) -> dict[str, Any]:
    """Target forwards of A and B on their common rows, τ each, and B's saving over A with its interval."""
    if cluster not in ("question", "turn"):
        raise ValueError(f"cluster must be 'question' or 'turn', got {cluster!r}")
    la, ra = load_rows(spec_a)
    lb, rb = load_rows(spec_b)
    if turn is not None:
        ra, rb = ({k: r for k, r in rows.items() if k[2] == turn} for rows in (ra, rb))
        if not ra or not rb:
            raise ValueError(f"turn={turn}: {la if not ra else lb} has no rows for that turn (turns count from 0)")
    group = (lambda k: k[:2]) if cluster == "question" else None  # (setting, question_id)
    res = paired_forwards(ra, rb, la, lb, boot, seed, cluster=group)
    return {**res, "cluster": cluster, "turn": "all" if turn is None else turn}


def main(argv: list[str]) -> int:
    specs = [a for a in argv if "=" not in a]
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    if len(specs) != 2:
        print(__doc__)
        return 2
    try:
        turn = opts.get("turn")
        res = compare(specs[0], specs[1], int(opts.get("boot", 10000)), int(opts.get("seed", 0)),
                      opts.get("cluster", "question"), None if turn is None else int(turn))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    job.cli(main, sys.argv[1:])
