"""τ, the field's headline number, and whether one draft's lead over another is more than prompt noise.

τ = (accepted draft tokens + target forwards) / target forwards: each verification forward emits its accepted
draft tokens plus the target's own next token, so plain decoding has τ = 1.

Two drafts measured on the same 80 prompts often differ by a handful of target forwards out of ~1,400. Pairing
each prompt's forwards across the two and resampling prompts (a paired bootstrap) gives a confidence interval
for the difference, so a table can say "ahead" or "within noise" from numbers rather than by eye. No torch
import: ``scripts/paired_tau.py`` uses this on stored results too.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

MIN_PROMPTS = 10  # fewer paired prompts than this: no verdict (a percentile bootstrap over 2-9 values says little)


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


def paired_bootstrap(a: list[int], b: list[int], boot: int = 10000, seed: int = 0,
                     groups: Sequence[Hashable] | None = None) -> dict[str, Any]:
    """Sum of per-prompt differences a - b (forwards saved by b) with a percentile 95% interval.

    ``groups`` (one label per prompt) resamples whole groups instead of single prompts: a question's two turns
    share a topic and an answer style, so treating them as independent draws understates the noise."""
    assert len(a) == len(b) and a, "paired lists must be non-empty and of equal length"
    assert groups is None or len(groups) == len(a), "one group label per paired prompt"
    d = [x - y for x, y in zip(a, b)]
    per_group: dict[Hashable, int] = {}
    for i, x in enumerate(d):
        g = i if groups is None else groups[i]
        per_group[g] = per_group.get(g, 0) + x
    units = list(per_group.values())  # the resampled units: prompts, or groups of them
    rng = random.Random(seed)
    n = len(units)
    sums = sorted(sum(units[rng.randrange(n)] for _ in range(n)) for _ in range(boot))
    return {"saved": sum(d), "ci95": [sums[int(0.025 * boot)], sums[int(0.975 * boot) - 1]],
            "prompts_b_better": sum(x > 0 for x in d), "prompts_b_worse": sum(x < 0 for x in d), "prompts": len(d),
            "resampled_units": n}


def paired_forwards(ra: Mapping[Any, dict[str, Any]], rb: Mapping[Any, dict[str, Any]], label_a: str, label_b: str,
                    boot: int = 10000, seed: int = 0, strict: bool = True,
                    cluster: Callable[[Any], Hashable] | None = None) -> dict[str, Any]:
    """Target forwards of A and B on their common turns (dicts keyed alike, e.g. by (setting, question, turn)),
    τ each, and B's saving over A with its paired-bootstrap interval and a verdict.

    Forwards only compare at equal output length (true for greedy fp32 runs of one target, which are
    token-identical) on the same prompt: ``strict`` raises on a turn where lengths or prompts differ, otherwise
    such turns are left out and counted in ``unequal_turns_skipped``. ``cluster`` maps a key to the unit the
    bootstrap resamples (e.g. its question, so both turns move together); None resamples single turns."""
    keys = sorted(set(ra) & set(rb), key=str)
    if not keys:
        raise ValueError(f"{label_a} and {label_b} share no (setting, question, turn) rows")

    def why_not(k: Any) -> str | None:
        x, y = ra[k], rb[k]
        if x.get("prompt_hash") and y.get("prompt_hash") and x["prompt_hash"] != y["prompt_hash"]:
            return "their prompts differ (an earlier turn's answers diverged)"
        if x["new_tokens"] != y["new_tokens"]:
            return f"{label_a} emitted {x['new_tokens']} tokens, {label_b} {y['new_tokens']}"
        return None

    unequal = {k: why for k in keys if (why := why_not(k))}
    if unequal and strict:
        k, why = next(iter(unequal.items()))
        raise ValueError(f"row {k}: {why}; forwards only compare at equal output length on the same prompt")
    keys = [k for k in keys if k not in unequal]
    if not keys:
        raise ValueError(f"{label_a} and {label_b}: no turn with equal output length on the same prompt to compare")
    fa = [ra[k]["steps"] for k in keys]
    fb = [rb[k]["steps"] for k in keys]
    out = {"a": label_a, "b": label_b, "rows": len(keys), "unequal_turns_skipped": len(unequal),
           "tokens": sum(ra[k]["new_tokens"] for k in keys), "forwards_a": sum(fa), "forwards_b": sum(fb),
           "tau_a": tau(ra[k] for k in keys), "tau_b": tau(rb[k] for k in keys)}
    out.update(paired_bootstrap(fa, fb, boot, seed, None if cluster is None else [cluster(k) for k in keys]))
    lo, hi = out["ci95"]
    if out["resampled_units"] < MIN_PROMPTS:
        unit = "prompts" if cluster is None else "questions"
        out["verdict"] = f"too few {unit} ({out['resampled_units']} < {MIN_PROMPTS})"
    else:
        out["verdict"] = "b ahead" if lo > 0 else "a ahead" if hi < 0 else "within noise"
    return out
