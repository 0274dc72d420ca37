"""Is one draft's τ lead over another more than prompt noise? A paired bootstrap over prompts (prints JSON).

Why: see eval/tau.py. ``eval/measure.py`` reports the same comparison for every pair of heads it measured
together; this script pairs heads from two separate measure runs.

    python scripts/paired_tau.py runs/measure/A:eagle runs/measure/B:eagle3 [boot=10000] [seed=0]

Each argument is ``RUN:METHOD``: a directory written by ``eval/measure.py`` (or its ``results.json``) and a
method name in it. Rows are paired by (setting, question_id, turn); both sides must emit the same number of
tokens per row (true for greedy runs of the same target, which are token-identical).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.tau import paired_forwards  # noqa: E402


def load_rows(spec: str) -> tuple[str, dict[tuple, dict[str, Any]]]:
    """``RUN:METHOD`` -> (label, {(setting, question_id, turn): row})."""
    if ":" not in spec:
        raise ValueError(f"expected RUN:METHOD (e.g. runs/measure/x:eagle), got {spec!r}")
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


def compare(spec_a: str, spec_b: str, boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Target forwards of A and B on their common rows, τ each, and B's saving over A with its interval."""
    la, ra = load_rows(spec_a)
    lb, rb = load_rows(spec_b)
    return paired_forwards(ra, rb, la, lb, boot, seed)


def main(argv: list[str]) -> int:
    specs = [a for a in argv if "=" not in a]
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    if len(specs) != 2:
        print(__doc__)
        return 2
    try:
        res = compare(specs[0], specs[1], int(opts.get("boot", 10000)), int(opts.get("seed", 0)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
