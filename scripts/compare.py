"""Print eval result JSONs side by side: python scripts/compare.py a.json b.json [...] [--md]

When any result was run with ``compare_plain=true``, plain decoding gets its own column (τ 1 by definition,
its tokens/s) and every column gets ``× plain`` = its tokens/s over plain's: what a head buys in wall clock,
not only in τ. Plain's figure comes from the first result that carries one (all runs of one quickstart share
the machine and the questions).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(p: str) -> dict:
    return json.loads(Path(p).read_text())


def table(paths: list[str], markdown: bool = False) -> str:
    res = [load(p) for p in paths]
    names = [r["drafter"].get("label") or r["drafter"]["drafter"] for r in res]
    plain = next((r["plain"] for r in res if "plain" in r), None)
    cats = sorted({c for r in res for c in r["summary"]["per_category"]})
    lead = ["plain"] if plain else []
    rows = [["category"] + lead + names]
    for c in cats:
        rows.append([c] + ["1.000"] * len(lead) +
                    [f"{r['summary']['per_category'][c]['tau']:.3f}" if c in r["summary"]["per_category"]
                     else "-" for r in res])
    rows.append(["overall τ"] + ["1.000"] * len(lead) + [f"{r['summary']['tau']:.3f}" for r in res])
    tps = [r["summary"]["tokens_per_s"] for r in res]
    rows.append(["tokens/s"] + [f"{p['tokens_per_s']:.1f}" for p in [plain] if p] + [f"{t:.1f}" for t in tps])
    if plain:
        rows.append(["× plain"] + ["1.00"] + [f"{t / max(plain['tokens_per_s'], 1e-9):.2f}" for t in tps])
    rows.append(["tree nodes"] + ["1"] * len(lead) + [str(r["drafter"].get("tree_size", 1)) for r in res])
    depth = max(len(r["summary"]["accept_at_depth"]) for r in res)
    for d in range(depth):
        rows.append([f"accept@{d + 1}"] + ["-"] * len(lead) +
                    [f"{r['summary']['accept_at_depth'][d]:.3f}" if d < len(r["summary"]["accept_at_depth"])
                     else "-" for r in res])
    if markdown:
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(out)
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w[i]) for i, x in enumerate(r)) for r in rows)


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(lambda: print(table([a for a in sys.argv[1:] if a != "--md"], markdown="--md" in sys.argv)))
