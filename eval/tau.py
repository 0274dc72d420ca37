"""τ, the field's headline number, in one place (no torch import: stats scripts use it too).

τ = (accepted draft tokens + target forwards) / target forwards: each verification forward emits its accepted
draft tokens plus the target's own next token, so plain decoding has τ = 1.
"""

from __future__ import annotations

from typing import Any, Iterable


def tau_value(accepted: int, steps: int) -> float:
    """τ from totals: draft tokens accepted over ``steps`` target forwards (no forwards: 0, nothing measured)."""
    return (accepted + steps) / max(1, steps)


def tau(rows: Iterable[dict[str, Any]]) -> float:
    """τ over measured turns, each with ``steps`` (target forwards) and ``accepted_total`` (draft tokens kept)."""
    steps = accepted = 0
    for r in rows:
        steps += r["steps"]
        accepted += r["accepted_total"]
    return tau_value(accepted, steps)
