"""EAGLE-3 drafting for the generation loop: the EAGLE drafter's cache bookkeeping and EAGLE-2 dynamic
tree, with fused aux features as the committed inputs and draft-vocabulary ids mapped to target ids.

Committed entries (positions < cur) read fc(concat of the target's aux-layer states) — the true
features; tree entries at depth d read the draft's own output after their parent, at position
cur+d-1, exactly the pairs the training-time test trains on (step d-1 at position cur-1). Children
are the top-k of the draft-vocabulary distribution, mapped back with ``d2t`` (target id = draft id
+ d2t[draft id]); the target verifies them like any tree, so greedy output equals plain greedy.
"""

from __future__ import annotations

from typing import Any

import torch

from draftheads.eval.eagle_drafter import EagleDrafter, EagleTreeConfig
from draftheads.heads.eagle3 import Eagle3Draft
from draftheads.heads.target import FrozenTarget


class Eagle3Drafter(EagleDrafter):
    """Drafter protocol (eval.generate) for an EAGLE-3 draft; dynamic (EAGLE-2), static or chain trees."""

    draft: Eagle3Draft

    @staticmethod
    def _feature_layers(draft: Any) -> tuple[int, ...]:
        return tuple(draft.config.aux_layers)

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        aux = torch.cat([hidden[a].to(self.device) for a in self.layers], dim=-1)  # [m, n_aux·H]
        return self.draft.fuse(aux)  # [m, H]

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.draft.to_target(ids.to(self.device))

    def _lm_weight(self) -> torch.Tensor:
        return self.draft.lm_head.weight  # [DV, H] the draft vocabulary's rows

    def _lm_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.draft.norm(h.to(self._lm_weight().dtype))


def build_eagle3_drafter(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                         allow_target_mismatch: bool = False) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """Load an EAGLE-3 checkpoint for ``target`` and wrap it with the configured tree."""
    if not head:
        raise ValueError("drafter=eagle3 needs checkpoint=<head dir>")
    draft = Eagle3Draft.from_pretrained(head, target, allow_target_mismatch).to(target.device)
    tc = EagleTreeConfig.from_any(tree_cfg)
    drafter = Eagle3Drafter(draft, tc, dtype)
    if drafter.static is not None:
        desc = {"tree_kind": tc.kind, "tree_size": drafter.static.size, "tree_depth": drafter.static.max_depth}
    else:
        desc = {"tree_kind": "dynamic", "tree_size": tc.nodes + 1, "tree_depth": tc.depth, "tree_top_k": tc.top_k}
    return drafter, {"drafter": "eagle3", "head": head, "aux_layers": list(draft.config.aux_layers),
                     "draft_vocab_size": draft.config.draft_vocab_size, **desc}
