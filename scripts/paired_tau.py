"""Is one draft's τ lead over another more than prompt noise? A paired bootstrap over prompts (prints JSON).

Why: two drafts measured on the same 80 prompts often differ by a handful of target forwards out of ~1,400.
Pairing each prompt's forwards across the two runs and resampling prompts gives a confidence interval for
the difference, so a table can say "ahead" or "within noise" from numbers rather than by eye.

    python scripts/paired_tau.py runs/measure/A:eagle runs/measure/B:eagle3 [boot=10000] [seed=0]

Each argument is ``RUN:METHOD``: a directory written by ``eval/measure.py`` (or its ``results.json``) and a
method name in it. Rows are paired by (setting, question_id, turn); both sides must emit the same number of
tokens per row (true for greedy runs of the same target, which are token-identical).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.tau import tau  # noqa: E402


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


def paired_bootstrap(a: list[int], b: list[int], boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Sum of per-prompt differences a - b (forwards saved by b) with a percentile 95% interval."""
    assert len(a) == len(b) and a, "paired lists must be non-empty and of equal length"
    d = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    n = len(d)
    sums = sorted(sum(d[rng.randrange(n)] for _ in range(n)) for _ in range(boot))
    return {"saved": sum(d), "ci95": [sums[int(0.025 * boot)], sums[int(0.975 * boot) - 1]],
            "prompts_b_better": sum(x > 0 for x in d), "prompts_b_worse": sum(x < 0 for x in d), "prompts": n}


def compare(spec_a: str, spec_b: str, boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Target forwards of A and B on their common rows, τ each, and B's saving over A with its interval."""
    la, ra = load_rows(spec_a)
    lb, rb = load_rows(spec_b)
    keys = sorted(set(ra) & set(rb), key=str)
    if not keys:
        raise ValueError(f"{la} and {lb} share no (setting, question, turn) rows")
    for k in keys:
        if ra[k]["new_tokens"] != rb[k]["new_tokens"]:
            raise ValueError(f"row {k}: {la} emitted {ra[k]['new_tokens']} tokens, {lb} {rb[k]['new_tokens']}; "
                             f"forwards only compare at equal output length")
    fa = [ra[k]["steps"] for k in keys]
    fb = [rb[k]["steps"] for k in keys]
    tokens = sum(ra[k]["new_tokens"] for k in keys)
    out = {"a": la, "b": lb, "rows": len(keys), "tokens": tokens, "forwards_a": sum(fa), "forwards_b": sum(fb),
           "tau_a": tau(ra[k] for k in keys), "tau_b": tau(rb[k] for k in keys)}
    out.update(paired_bootstrap(fa, fb, boot, seed))
    lo, hi = out["ci95"]
    out["verdict"] = "b ahead" if lo > 0 else "a ahead" if hi < 0 else "within noise"
    return out


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
