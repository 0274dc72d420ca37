"""Drafters for the generation loop: Medusa heads (static tree), and a factory from checkpoints
(EAGLE drafts live in eval/eagle_drafter.py, EAGLE-3 drafts in eval/eagle3_drafter.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftheads.eval.draft_logits import ScreenedTopK, screening_available
from draftheads.eval.generate import DraftTree, NoDrafter
from draftheads.eval.trees import StaticTree, ancestor_mask, default_tree, generic_accuracies, static_tree
from draftheads.heads import registry
from draftheads.heads.checkpoint import read_head_config
from draftheads.heads.medusa import MedusaHeads, medusa_config_for
from draftheads.heads.target import FrozenTarget


class MedusaDrafter:
    """Static-tree drafting from Medusa heads: depth-d nodes take head d's ranked candidates."""

    layers = (-1,)

    def __init__(self, heads: MedusaHeads, tree: StaticTree, dtype: torch.dtype | None = None,
                 screen: bool | None = None):
        """``screen``: int8-screened top-k per head (eval.draft_logits); None = where it pays (bf16/fp16 CPU)."""
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(f"tree depth {tree.max_depth} exceeds the {heads.config.num_heads} Medusa heads")
        self.heads = heads.eval()
        if dtype is not None:
            self.heads.to(dtype)
        K = tree.max_depth
        ws = ([heads._shared_lm_head.weight] if heads.lm_heads is None
              else [heads.lm_heads[k].weight for k in range(K)])  # [V, H] each
        use = screening_available(ws[0]) if screen is None else screen
        self._screens = [ScreenedTopK(w) for w in ws] if use else None
        self.tree = tree
        self.topk = max(tree.max_rank())
        self.mask = ancestor_mask(tree.parents)
        # node i (>0) reads candidate table entry [depth-1, rank]
        self._flat = ((tree.depths[1:] - 1) * self.topk + tree.ranks[1:])
        self.h: torch.Tensor | None = None

    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.h = hidden[-1][-1]  # [H] last prompt position

    @torch.no_grad()
    def propose(self, root: int, sampling: Any, generator: Any) -> DraftTree:
        assert self.h is not None
        K = self.tree.max_depth
        h = self.h.to(next(self.heads.parameters(), self.h).dtype)
        hk = torch.stack([self.heads.head_hidden(k, h) for k in range(K)])  # [K, H]
        cands = self._candidates(hk)  # [K, topk]
        tokens = torch.cat([torch.tensor([root], device=cands.device), cands.view(-1)[self._flat.to(cands.device)]])
        return DraftTree(tokens.cpu(), self.tree.parents, None, self.tree.depths, self.mask)

    def accept(self, tree: DraftTree, path, next_token: int, hidden: dict[int, torch.Tensor]) -> None:
        self.h = hidden[-1][-1]  # [H] at the last accepted node

    def _candidates(self, hk: torch.Tensor) -> torch.Tensor:
        """[K, H] head states -> [K, topk] ranked candidate ids per head."""
        K = hk.shape[0]
        if self._screens is not None and len(self._screens) == 1:  # shared lm_head: one screen over all K rows
            return self._screens[0].topk(hk, self.topk, logprobs=False)[0]
        if self._screens is not None:
            return torch.cat([s.topk(hk[k: k + 1], self.topk, logprobs=False)[0] for k, s in enumerate(self._screens)])
        if self.heads.lm_heads is None:  # one [K, H] x [H, V] product reads the shared weight once
            logits = self.heads.project(0, hk)  # [K, V]
        else:
            logits = torch.stack([self.heads.project(k, hk[k]) for k in range(K)])  # [K, V]
        return logits.topk(self.topk, dim=-1).indices


def checkpoint_family(path: str | Path) -> str:
    return read_head_config(path)["family"]


def build_drafter(kind: str, target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                  allow_target_mismatch: bool = False, num_heads: int = 4, baselines: Any = None,
                  shared: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Make the drafter for the eval job; returns (drafter, description).

    ``kind``: plain, auto (the checkpoint's family), a registered family or a registered baseline (heads/registry.py).
    ``baselines``: options of the baseline drafters (conf/baselines/default.yaml: draft_model, draft_tokens,
    lookup_tokens, lookup_max_ngram, lookup_min_ngram). ``shared``: a per-job dict where a baseline keeps what is
    costly to rebuild between sizes (a loaded draft LM). A drafter whose shape drafts trees may carry
    ``tree.lookup_branch``.
    """
    if kind == "auto":
        kind = checkpoint_family(head) if head else "plain"
    if kind == "plain":
        return NoDrafter(), {"drafter": "plain"}
    if kind in registry.BASELINES:
        out = registry.BASELINES[kind].load("drafter")(target, head, tree_cfg, dtype, baselines, num_heads, shared)
    elif kind in registry.FAMILIES:
        out = registry.get(kind).load("drafter")(target, head, tree_cfg, dtype, allow_target_mismatch)
    else:
        raise ValueError(f"unknown drafter {kind!r}; expected auto, plain, a baseline ({', '.join(registry.BASELINES)})"
                         f" or a registered family ({', '.join(registry.FAMILIES)})")
    return with_lookup_branch(*out, tree_cfg, baselines) if registry.shape_of(kind).branchable else out


def with_lookup_branch(drafter: Any, desc: dict[str, Any], tree_cfg: Any, baselines: Any = None,
                       ) -> tuple[Any, dict[str, Any]]:
    """Merge up to ``tree.lookup_branch`` prompt-lookup tokens into a head's tree (eval/lookup_branch.py); 0/null: off.

    The lookup is the prompt-lookup baseline's drafter, with its n-gram options from ``baselines``."""
    from draftheads.heads.job import config_int

    n = config_int(tree_cfg, "lookup_branch", 0, 0, "tree")
    if not n:
        return drafter, desc
    from draftheads.eval.baselines import prompt_lookup_from
    from draftheads.eval.lookup_branch import LookupBranch

    lookup = prompt_lookup_from({**dict(baselines or {}), "lookup_tokens": n})
    return LookupBranch(drafter, lookup), {**desc, "lookup_branch": n}


def build_untrained_medusa(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                           baselines: Any = None, num_heads: int = 4, shared: dict[str, Any] | None = None,
                           ) -> tuple[MedusaDrafter, dict[str, Any]]:
    """``num_heads`` identity-initialized Medusa heads on their tree: the untrained reference (a baseline)."""
    return build_medusa_drafter(target, head, tree_cfg, dtype, num_heads=num_heads, untrained=True)


def build_medusa_drafter(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                         allow_target_mismatch: bool = False, num_heads: int = 4, untrained: bool = False,
                         ) -> tuple[MedusaDrafter, dict[str, Any]]:
    """Medusa heads from ``head`` (``untrained``: ``num_heads`` identity-initialized ones) on their tree."""
    if (tree_cfg.get("kind") or "auto") not in ("auto", "static"):
        raise ValueError(f"Medusa heads draft static trees only; got tree.kind={tree_cfg.get('kind')!r}")
    if not untrained:
        if not head:
            raise ValueError("drafter=medusa needs checkpoint=<head dir>")
        heads = MedusaHeads.from_pretrained(head, target, allow_target_mismatch).to(target.device)
        stats = read_head_config(head).get("rank_accuracy")
    else:
        heads = MedusaHeads(medusa_config_for(target, num_heads, 1, True), target.lm_head())
        stats = None
    tree, source = ranked_static_tree(tree_cfg, heads.config.num_heads, stats)
    return MedusaDrafter(heads, tree, dtype), {
        "drafter": "medusa-init" if untrained else "medusa", "head": head, "tree_size": tree.size,
        "tree_depth": tree.max_depth, "tree_source": source}


def ranked_static_tree(tree_cfg: Any, num_heads: int, rank_accuracy: Any) -> tuple[StaticTree, str]:
    """A static tree over ``num_heads`` positions that each offer ranked candidates (Medusa's heads, a block draft's
    positions): custom ``tree.paths`` if given; else ``tree.size`` nodes (null: 64) tuned to the checkpoint's
    measured per-rank accuracies; else a generic default. ``tree_cfg``: a mapping or an OmegaConf node."""
    if tree_cfg.get("paths"):
        return static_tree(tree_cfg.get("paths")), "custom"
    from draftheads.heads.job import config_int  # null = every head; 0 is an error, not "every head"

    depth = min(num_heads, config_int(tree_cfg, "max_depth", num_heads, 1, "tree"))
    size = config_int(tree_cfg, "size", 64, 2, "tree")
    if rank_accuracy is not None and tree_cfg.get("tuned", True):
        # A tiny generic prior breaks ties (and fills in ranks never hit on a small held-out set).
        prior = generic_accuracies(depth, len(rank_accuracy[0]))
        acc = [[a + 1e-4 * p for a, p in zip(row, prow)] for row, prow in zip(rank_accuracy[:depth], prior)]
        return default_tree(depth, size, acc), "tuned"
    return default_tree(depth, size), "generic"
