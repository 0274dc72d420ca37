"""The model tree=auto ranks trees by: the candidate trees of each family with their expected tokens per step
(from the acceptance table), the target's verify time at a width anchored to the loop's own timings, and the
drafter's per-step time interpolated between the timed configurations.

Apart from the choice (eval/autotree.py: probing, timing, reporting) because these are pure functions of measured
tables and timings, tested with toy ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from draftheads.eval.calibration import Timing, _interp
from draftheads.eval.latency import monotone, t_verify_ms
from draftheads.eval.trees import chain, expected_tokens, greedy_tree_order

MAX_WIDTH = 64  # largest tree considered (root included)


@dataclass
class Candidate:
    """A tree tree=auto may pick: its knobs, the width verified, the modeled E[accepted + 1], and its draft-cost key."""

    knobs: dict[str, Any]
    width: float
    expected: float
    draft_key: float  # the family's draft-cost knob: Medusa depth, EAGLE (depth, top_k) flattened by the caller, k


def medusa_candidates(table: torch.Tensor, fixed_depth: int | None) -> list[Candidate]:
    """Static trees of every size up to MAX_WIDTH, each the greedy best by acceptance for its size."""
    order, probs = greedy_tree_order(table, MAX_WIDTH - 1, max_depth=fixed_depth, rank_closed=False)
    if not order:  # nothing was ever accepted: the smallest tree still has to be a candidate
        order, probs = [(0,)], [float(table[0, 0]) if table.numel() else 0.0]
    out, e = [], 1.0
    for n in range(1, len(order) + 1):
        e += probs[n - 1]
        paths = sorted(order[:n], key=lambda p: (len(p), p))
        out.append(Candidate({"size": n + 1, "paths": [list(p) for p in paths]}, n + 1, e,
                             max(len(p) for p in paths)))
    return out


def dynamic_candidates(table: torch.Tensor, fixed: dict[str, int | None]) -> list[Candidate]:
    """Every (top_k, depth, nodes) a dynamic tree can take, explicit knobs held fixed."""
    D, R = table.shape
    out = []
    for depth in ([fixed["depth"]] if fixed["depth"] else range(1, D + 1)):
        for k in ([fixed["top_k"]] if fixed["top_k"] else range(1, R + 1)):
            order, probs = greedy_tree_order(table, MAX_WIDTH - 1, max_depth=depth, top_k=k, expand_per_depth=k)
            cap = min(MAX_WIDTH - 1, k + (depth - 1) * k * k)  # candidates a dynamic tree of this shape can keep
            e = 1.0
            for n in range(1, cap + 1):
                e += probs[n - 1] if n <= len(probs) else 0.0
                if fixed["nodes"] and n != fixed["nodes"]:
                    continue
                out.append(Candidate({"top_k": k, "depth": depth, "nodes": n}, n + 1, e, 0.0))
    return out


def chain_candidates(table: torch.Tensor, knob: str, lengths: Iterable[int]) -> list[Candidate]:
    """A chain of each length (prompt lookup, draft model, a chain-kind dynamic head), its knob named ``knob``."""
    out = []
    for k in lengths:
        c = chain(k)
        out.append(Candidate({knob: k}, k + 1, expected_tokens(c.parents, c.depths, c.ranks, table), float(k)))
    return out


def anchored_verify(profile: dict[str, Any], timings: Sequence[Timing]) -> Callable[[float], float]:
    """t_verify(width): the profile's shape, scaled to what the decoding loop's own forwards cost.

    Why: the profile times one context (300 tokens) once, and on a shared machine its points are noisy;
    the timed calibration runs measure target ms per step at a few widths, at real contexts and under the
    load of the moment. Each of those anchors gives a scale = loop ms / profile ms; between anchors the
    scale is interpolated over log2(width) (flat past the ends). The profile's best-of-repeats (ms_min)
    shape is used, made non-decreasing."""
    pts = sorted(profile["points"], key=lambda p: p["width"])
    ws = [p["width"] for p in pts]
    ms = monotone([p.get("ms_min", p["ms"]) for p in pts])
    shape = lambda w: float(np.interp(w, ws, ms))  # noqa: E731
    by_w: dict[float, list[float]] = {}
    for t in timings:
        if t.steps and t.target_ms > 0:
            by_w.setdefault(round(t.width, 3), []).append(t.target_ms / shape(t.width))
    if not by_w:
        return lambda w: t_verify_ms(profile, w)
    xs = sorted(by_w)
    lx, sc = [math.log2(x) for x in xs], [float(np.mean(by_w[x])) for x in xs]
    return lambda w: shape(w) * float(np.interp(math.log2(max(w, 1.0)), lx, sc))


def interp_ms(xs: Sequence[float], ys: Sequence[float]) -> Callable[[Candidate], float]:
    """A candidate's per-step draft ms, interpolated in its draft-cost key between timed configurations."""
    return lambda c: max(0.0, _interp(c.draft_key, xs, ys))
