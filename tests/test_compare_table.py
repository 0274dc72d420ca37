"""scripts/compare.py: τ per column, and plain's tokens/s with × plain for every column when one run has plain."""

from __future__ import annotations

import json
from pathlib import Path

from draftheads.scripts.compare import table


def _result(path: Path, name: str, tau: float, tps: float, plain_tps: float | None = None) -> str:
    r = {"drafter": {"drafter": name, "tree_size": 8},
         "summary": {"tau": tau, "tokens_per_s": tps, "accept_at_depth": [0.5, 0.25],
                     "per_category": {"writing": {"tau": tau}}}}
    if plain_tps is not None:
        r["plain"] = {"tau": 1.0, "tokens_per_s": plain_tps}
    path.write_text(json.dumps(r))
    return str(path)


def test_plain_column_and_times_plain(tmp_path: Path) -> None:
    a = _result(tmp_path / "a.json", "medusa-init", 1.2, 8.0)
    b = _result(tmp_path / "b.json", "medusa", 1.5, 24.0, plain_tps=16.0)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table([a, b], markdown=True).splitlines()[2:]}
    assert rows["overall τ"] == ["1.000", "1.200", "1.500"]
    assert rows["tokens/s"] == ["16.0", "8.0", "24.0"]
    assert rows["× plain"] == ["1.00", "0.50", "1.50"]


def test_without_plain_there_is_no_plain_column(tmp_path: Path) -> None:
    a = _result(tmp_path / "a.json", "medusa", 1.5, 24.0)
    text = table([a], markdown=True)
    assert "× plain" not in text and "| category | medusa |" in text
