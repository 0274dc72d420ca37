"""Draft shapes as strategies: what a drafter proposes each step and everything tree=auto, sweeps and reports need
to know about it — its free knobs, its sweep size knob, the probe that measures its acceptance table, the timed
configurations of its draft-cost knob, its candidate trees and its draft-cost model.

Why objects: code that serves every drafter (eval/autotree.py, eval/measure_methods.py) asks the drafter's shape
instead of branching on a shape or family name, so a new family (or a new shape) is its own files plus one
registration (heads/registry.py names a family's shape as ``"module:attr"``; baselines register theirs there too).

The shapes here: ``STATIC`` (fixed paths over per-position candidates, Medusa; sized by ``tree.size``, root
included), ``DYNAMIC`` (EAGLE-2 expansion; ``tree.nodes`` drafted, plus ``top_k`` and ``depth``; ``tree.kind=chain``
makes it a top-1 chain of ``tree.depth``), and ``ChainShape`` (a chain whose length is one knob: prompt lookup's
``baselines.lookup_tokens``, the draft model's ``baselines.draft_tokens``). ``NONE``: drafts nothing (plain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from draftheads.eval.autotree_knobs import explicit_knob
from draftheads.eval.autotree_model import (Candidate, chain_candidates, dynamic_candidates, interp_ms,
                                            medusa_candidates)
from draftheads.eval.calibration import _interp
from draftheads.eval.trees import generic_accuracies, greedy_tree_order
from draftheads.heads.checkpoint import read_head_config

Cfg = dict[str, Any]
PROBE = {"top_k": 10, "depth": 8, "nodes": 63, "size": 64}  # the wide trees a probe drafts


class Shape:
    """A drafter that drafts nothing tree=auto could size (plain decoding, transformers' generate)."""

    name = "none"
    drafts = False  # proposes tokens at all
    sweep: str | None = None  # which eval/measure.py sweep sizes it takes (sweep.tree_sizes / sweep.chain_sizes)
    branchable = False  # may carry tree.lookup_branch (a prompt-lookup chain merged into its tree): trained heads

    def free(self, tree: Cfg, base: Cfg) -> list[str]:
        """The knobs tree=auto would choose (null in the config), lookup_branch aside."""
        return []

    def apply_size(self, tree: Cfg, base: Cfg, size: int) -> None:
        """Set the sweep point ``size`` (nodes verified per step, root included) on the shape's own knob."""

    def probe(self, tree: Cfg, base: Cfg, num_heads: int, prior: Any) -> tuple[Cfg, Cfg, list[tuple[Cfg, Cfg]]]:
        """(probe tree, probe baselines, timing configs): explicit knobs kept in all of them."""
        raise ValueError(f"tree=auto has no trees to choose for a drafter of shape {self.name!r}")

    def table_dims(self, tree: Cfg, base: Cfg) -> tuple[int, int, bool]:
        """(depths, ranks, a missing node is a miss) of the acceptance table a probe of (tree, base) measures."""
        raise NotImplementedError

    def timing_label(self, tree: Cfg, base: Cfg) -> Cfg:
        """The knobs that tell a timed configuration apart (reports, and the draft-cost model's x)."""
        raise NotImplementedError

    def draft_ms_model(self, timings: Sequence[Any], tree: Cfg, base: Cfg) -> Callable[[Candidate], float]:
        """Per-step draft ms of a candidate, from the timed configurations (timings[0] is the probe)."""
        raise NotImplementedError

    def candidates(self, table: torch.Tensor, tree: Cfg, depth: int, num_heads: int) -> list[Candidate]:
        """Every tree tree=auto may pick, each with its modeled E[accepted + 1]."""
        raise NotImplementedError

    def is_default(self, knobs: Cfg, tree: Cfg, base: Cfg) -> bool:
        """Whether a candidate's ``knobs`` are the fixed defaults (filled ``tree`` / ``base``)."""
        return False

    def probe_desc(self, tree: Cfg, base: Cfg) -> Cfg:
        return {}

    def step_widths(self, records: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> list[int]:
        """Per-step proposal lengths when they vary below the cap (prompt lookup); [] when the cap is drafted."""
        return []

    def head_stats(self, checkpoint: str | None, tree: Cfg, num_heads: int) -> tuple[int, Any]:
        """(head count, per-rank accuracies) a checkpoint records to shape the probe; (num_heads, None) if none."""
        return num_heads, None

    def finish(self, tree: Cfg, chosen: Cfg) -> None:
        """Fix up the chosen tree config (a static tree's size follows its chosen paths)."""


class StaticShape(Shape):
    """Fixed paths over per-position candidates (Medusa): sized by tree.size, root included; custom paths fix it."""

    name = "static"
    drafts = True
    sweep = "tree_sizes"
    branchable = True

    def free(self, tree: Cfg, base: Cfg) -> list[str]:
        return [] if tree.get("paths") or tree.get("size") is not None else ["size"]

    def apply_size(self, tree: Cfg, base: Cfg, size: int) -> None:
        tree["size"] = size

    def probe(self, tree, base, num_heads, prior):
        H = min(num_heads, int(tree.get("max_depth") or num_heads))
        ok = prior is not None and len(prior) >= H and all(len(r) == len(prior[0]) for r in prior[:H])
        acc = prior if ok else generic_accuracies(H)  # the checkpoint's per-rank accuracies shape the probe tree
        table = torch.tensor([list(r) for r in acc[:H]], dtype=torch.float64) + \
            1e-4 * torch.tensor(generic_accuracies(H, len(acc[0])), dtype=torch.float64)
        order, _ = greedy_tree_order(table, PROBE["size"] - 1)
        probe = {**tree, "paths": [list(p) for p in order], "size": len(order) + 1}
        timing = []
        if max(len(p) for p in order) > 1:  # draft cost grows with the heads run: time a depth-1 tree too
            timing = [({**tree, "paths": [[0]], "size": 2}, base)]
        return probe, base, timing

    def table_dims(self, tree, base):
        return max(len(p) for p in tree["paths"]), max(p[-1] for p in tree["paths"]) + 1, False

    def timing_label(self, tree, base):
        return {"paths": tree.get("paths")}

    def draft_ms_model(self, timings, tree, base):  # the heads up to the tree's depth run every step
        xs = [max(len(p) for p in tree["paths"])] + [max(len(p) for p in t.config["paths"]) for t in timings[1:]]
        return interp_ms(xs, [t.draft_ms for t in timings])

    def candidates(self, table, tree, depth, num_heads):
        return medusa_candidates(table, min(num_heads, int(tree.get("max_depth") or num_heads)))

    def is_default(self, knobs, tree, base):
        return knobs["size"] == tree["size"]

    def probe_desc(self, tree, base):
        return {"size": len(tree["paths"]) + 1}

    def head_stats(self, checkpoint, tree, num_heads):
        """(positions a tree can reach, the per-rank accuracies the checkpoint recorded, unless tree.tuned=false)."""
        if not checkpoint:
            return num_heads, None
        saved = read_head_config(checkpoint)
        return self.positions(saved["head_config"]), saved.get("rank_accuracy") if tree.get("tuned", True) else None

    def positions(self, head_config: dict[str, Any]) -> int:
        """Drafted positions of a checkpoint with this head config (Medusa: its heads)."""
        return int(head_config["num_heads"])

    def finish(self, tree, chosen):
        tree["size"] = chosen["size"]


class DynamicShape(Shape):
    """EAGLE-2 expansion: top_k per depth, depth levels, nodes kept; tree.kind=chain drafts a top-1 chain."""

    name = "dynamic"
    drafts = True
    sweep = "tree_sizes"
    branchable = True
    KNOBS = ("top_k", "depth", "nodes")

    @staticmethod
    def _chain(tree: Cfg) -> bool:
        return (tree.get("kind") or "auto") == "chain"

    def free(self, tree, base):
        if (tree.get("kind") or "auto") in ("auto", "dynamic"):
            return [n for n in self.KNOBS if tree.get(n) is None]
        return ["depth"] if self._chain(tree) and tree.get("depth") is None else []

    def apply_size(self, tree, base, size):
        tree["nodes"] = size - 1

    def probe(self, tree, base, num_heads, prior):
        k = tree.get("top_k") or (1 if self._chain(tree) else PROBE["top_k"])
        d = tree.get("depth") or PROBE["depth"]
        probe = {**tree, "kind": "dynamic", "top_k": k, "depth": d, "nodes": tree.get("nodes") or PROBE["nodes"]}
        pts = [(1, 1), (d, 1), (d, max(1, (k + 1) // 2))] if d > 1 else [(1, 1)]
        timing = [({**tree, "kind": "dynamic", "top_k": kk, "depth": dd, "nodes": min(8, dd * kk)}, base)
                  for dd, kk in dict.fromkeys(pts) if (dd, kk) != (d, k)]
        return probe, base, timing

    def table_dims(self, tree, base):
        return int(tree["depth"]), int(tree["top_k"]), False

    def timing_label(self, tree, base):
        return {k: tree[k] for k in self.KNOBS}

    def draft_ms_model(self, timings, tree, base):
        """One draft forward per depth over the top_k frontier: base + (depth-1)·slope(top_k)."""
        pts = {(int(tree["depth"]), int(tree["top_k"])): timings[0].draft_ms}
        for t in timings[1:]:
            pts[(int(t.config["depth"]), int(t.config["top_k"]))] = t.draft_ms
        first = pts.get((1, 1), min(pts.values()))
        deep = {k: v for (d, k), v in pts.items() if d > 1}
        dmax = max(d for d, _ in pts)
        if not deep:
            return lambda c: first
        ks = sorted(deep)
        slopes = [(deep[k] - first) / (dmax - 1) for k in ks]
        return lambda c: max(0.0, first + (c.knobs.get("depth", 1) - 1) * _interp(c.knobs.get("top_k", 1), ks, slopes))

    def candidates(self, table, tree, depth, num_heads):
        if self._chain(tree):
            return [Candidate({"depth": c.knobs["depth"]}, c.width, c.expected, 0.0)
                    for c in chain_candidates(table[:, :1], "depth", range(1, depth + 1))]
        return dynamic_candidates(table, {k: explicit_knob(tree, k, "tree") for k in self.KNOBS})

    def is_default(self, knobs, tree, base):
        return all(knobs.get(n, tree[n]) == tree[n] for n in self.KNOBS)

    def probe_desc(self, tree, base):
        return {k: tree[k] for k in self.KNOBS}


@dataclass(frozen=True)
class ChainShape(Shape):
    """A chain whose length is one knob, ``section.knob`` (``baselines.draft_tokens``; a family's own chain would
    use ``tree.depth``): the probe drafts ``probe_len``, the timing adds ``timed`` lengths; ``variable``: proposals
    are often shorter than the cap (prompt lookup finds no match); ``branchable``: a trained head's chain, which may
    carry ``tree.lookup_branch``."""

    knob: str
    probe_len: int
    timed: tuple[int, ...] = ()
    variable: bool = False
    section: str = "baselines"  # or "tree"
    branchable: bool = False
    name: str = "chain"
    drafts = True
    sweep = "chain_sizes"

    def _of(self, tree: Cfg, base: Cfg) -> Cfg:
        return tree if self.section == "tree" else base

    def _with(self, tree: Cfg, base: Cfg, n: int) -> tuple[Cfg, Cfg]:
        return ({**tree, self.knob: n}, base) if self.section == "tree" else (tree, {**base, self.knob: n})

    def free(self, tree, base):
        return [self.knob] if self._of(tree, base).get(self.knob) is None else []

    def apply_size(self, tree, base, size):
        self._of(tree, base)[self.knob] = size - 1

    def probe(self, tree, base, num_heads, prior):
        return (*self._with(tree, base, self.probe_len), [self._with(tree, base, n) for n in self.timed])

    def table_dims(self, tree, base):
        return int(self._of(tree, base)[self.knob]), 1, True

    def timing_label(self, tree, base):
        return {self.knob: self._of(tree, base)[self.knob]}

    def draft_ms_model(self, timings, tree, base):
        xs = [int(self._of(tree, base)[self.knob])] + [int(t.config[self.knob]) for t in timings[1:]]
        return interp_ms(xs, [t.draft_ms for t in timings])

    def candidates(self, table, tree, depth, num_heads):
        return chain_candidates(table, self.knob, range(1, depth + 1))

    def is_default(self, knobs, tree, base):
        v = self._of(tree, base)[self.knob]
        return knobs.get(self.knob, v) == v

    def probe_desc(self, tree, base):
        return {self.knob: self._of(tree, base)[self.knob]}

    def step_widths(self, records):
        return [len(p) - 1 for p, _, _ in records] if self.variable else []


NONE = Shape()
STATIC = StaticShape()
DYNAMIC = DynamicShape()
LOOKUP = ChainShape("lookup_tokens", probe_len=16, variable=True)  # prompt lookup
DRAFT_MODEL = ChainShape("draft_tokens", probe_len=8, timed=(1,))  # a small LM drafting a chain
