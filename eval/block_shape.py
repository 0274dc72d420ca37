"""The block draft's shape for tree=auto: any static tree over its positions' candidates, or a chain.

Why its own shape: one draft forward gives every block position's distribution, so unlike Medusa (whose draft cost
grows with the heads a tree reaches) or EAGLE (one forward per depth) a block draft's cost does not depend on the
tree it drafts; only the verification forward pays for width. tree=auto therefore chooses among Medusa-style
static trees over block positions (the chains among them) by measured acceptance, timing the probe alone.
``tree.kind=chain`` keeps a top-1 chain whose length ``tree.depth`` is the knob.
"""

from __future__ import annotations

from typing import Any

from draftheads.eval.autotree_model import Candidate, chain_candidates, medusa_candidates
from draftheads.eval.shapes import Cfg, StaticShape


def _chain(tree: Cfg) -> bool:
    return (tree.get("kind") or "auto") == "chain"


class BlockShape(StaticShape):
    """Static trees over block positions sized by ``tree.size`` (root included), or a chain of ``tree.depth``."""

    name = "block"

    def free(self, tree: Cfg, base: Cfg) -> list[str]:
        if _chain(tree):
            return ["depth"] if tree.get("depth") is None else []
        return super().free(tree, base)

    def apply_size(self, tree: Cfg, base: Cfg, size: int) -> None:
        if _chain(tree):
            tree["depth"] = size - 1
        else:  # a sized static tree
            tree["kind"], tree["size"] = "static", size

    def probe(self, tree, base, num_heads, prior):
        if _chain(tree):
            return {**tree, "depth": num_heads}, base, []
        probe, base, _ = super().probe(tree, base, num_heads, prior)
        return probe, base, []  # one forward drafts any tree: the probe's own timing is the draft cost

    def table_dims(self, tree, base):
        return (int(tree["depth"]), 1, True) if _chain(tree) else super().table_dims(tree, base)

    def timing_label(self, tree, base):
        return {"depth": tree.get("depth")} if _chain(tree) else super().timing_label(tree, base)

    def draft_ms_model(self, timings, tree, base):
        ms = timings[0].draft_ms
        return lambda c: ms

    def candidates(self, table, tree, depth, num_heads) -> list[Candidate]:
        if _chain(tree):
            return chain_candidates(table[:, :1], "depth", range(1, depth + 1))
        return medusa_candidates(table, min(num_heads, int(tree.get("max_depth") or num_heads)))

    def is_default(self, knobs, tree, base):
        return knobs.get("depth", tree["depth"]) == tree["depth"] if _chain(tree) else super().is_default(knobs, tree,
                                                                                                           base)

    def probe_desc(self, tree, base):
        return {"depth": tree["depth"]} if _chain(tree) else super().probe_desc(tree, base)

    def positions(self, head_config: dict[str, Any]) -> int:
        return int(head_config["block_size"]) - 1  # the root is not drafted

    def finish(self, tree, chosen):
        if not _chain(tree):
            super().finish(tree, chosen)


SHAPE = BlockShape()
