"""Block drafting for the generation loop: one draft forward proposes tokens for up to ``block_size - 1`` positions,
as a chain or as a static tree over the positions' candidates.

With a draft vocabulary the draft's distributions are over its own ids; they are mapped to target ids (zero
outside the vocabulary) before drafting, so q is what the exact rule reads.

Bookkeeping (cur = tokens in the target's cache; the root x_cur is the last accepted token):

* The draft's cache holds one *committed* context entry per position t < cur, made from the target's hidden
  states at t. After the prefill those are positions 0..cur-1; after a step, the target's hidden states of the
  root and the accepted drafts arrive through ``accept`` and are committed on the next ``propose``.
* ``propose`` commits the pending context entries (prefix layout: run causally through the layers; kv layout:
  only projected to each layer's keys and values), then runs the whole block [root, mask, ..., mask] (block_size
  entries, as training scores it, whatever a step drafts) at positions cur..cur+n; block entries attend to all
  committed entries and to each other. Entry j >= 1 gives the draft's distribution of the token j places after
  the root. The block's keys and values are dropped again, so the cache always equals a fresh prefill of the
  accepted text's context.
* The drafted tokens form a static tree over block positions: a node at depth j takes a candidate of position j,
  as Medusa's nodes take their head's. Every position's distribution comes from the one forward and conditions
  on no drafted token, so a tree of any shape costs one draft forward; a chain is the tree of rank-0 paths.
* Greedy: a node of rank r takes position j's r-th most likely token. Sampling: position j's candidates are drawn
  from its own distribution q_j without replacement (Gumbel top-k: the same law as drawing one after another), the
  i-th child of a node taking the i-th draw, and every node reports q_j in ``draft_probs``; so the siblings the
  verifier meets are sequential draws from q_j, which is what the exact rule (min(1, p/q), residual max(0, p - q),
  the rejected token removed from q) needs to keep the target's distribution.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from draftheads.eval.draft_cache import DraftKVCache
from draftheads.eval.drafters import ranked_static_tree
from draftheads.eval.generate import DraftTree
from draftheads.eval.trees import StaticTree, ancestor_mask, chain
from draftheads.eval.verify import apply_sampling
from draftheads.heads.block import BlockDraft
from draftheads.heads.checkpoint import read_head_config
from draftheads.heads.target import FrozenTarget


class LayerCaches:
    """One preallocated :class:`DraftKVCache` per draft layer, behind the one method a layer calls (``update``)."""

    def __init__(self, n: int, capacity: int):
        self.caches = [DraftKVCache(capacity) for _ in range(n)]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0, *args: Any, **kwargs: Any):
        return self.caches[layer_idx].update(k, v)

    def crop(self, length: int) -> None:
        for c in self.caches:
            c.crop(length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.caches[layer_idx].length

    def filled(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's filled keys/values [1, nkv, length, d] (views)."""
        return [(c.layers[0].keys, c.layers[0].values) for c in self.caches]


class BlockDrafter:
    """Drafter protocol (eval.generate) for a block draft: a static tree over block positions (``tree``; default a
    chain of ``tokens``) from one forward."""

    def __init__(self, draft: BlockDraft, tokens: int | None = None, dtype: torch.dtype | None = None,
                 tree: StaticTree | None = None):
        self.draft = draft.eval()
        if dtype is not None:
            self.draft.cast(dtype)
        most = draft.config.block_size - 1
        if tree is None:
            k = most if tokens is None else int(tokens)
            if not 1 <= k <= most:
                raise ValueError(f"tree.depth={tokens}: this block draft proposes 1..{most} tokens per step "
                                 f"(block_size {draft.config.block_size})")
            tree = chain(k)
        elif tree.max_depth > most:
            raise ValueError(f"tree depth {tree.max_depth} (tree.paths / tree.max_depth): this block draft proposes "
                             f"1..{most} positions per step (block_size {draft.config.block_size})")
        self.tree = tree
        self.k = tree.max_depth  # block positions drafted
        self.layers = tuple(draft.config.context_layers)  # what generate() must hand us from the target
        self._parents, self._depths = tree.parents, tree.depths
        self._mask = ancestor_mask(tree.parents)
        sib = torch.tensor(self._siblings(tree))  # [N-1] each node's index among its parent's children
        self.topk = max(max(tree.max_rank()), int(sib.max()) + 1)
        if self.topk > draft.out_vocab:
            raise ValueError(f"tree rank {self.topk - 1} (tree.paths / tree.size): this block draft has only "
                             f"{draft.out_vocab} candidates per position")
        self._rank_at = (tree.depths[1:] - 1) * self.topk + tree.ranks[1:]  # [N-1] greedy: candidate (depth, rank)
        self._draw_at = (tree.depths[1:] - 1) * self.topk + sib  # sampling: the i-th child takes the i-th draw
        self.cache: LayerCaches | None = None
        self.committed = 0
        self._pending: torch.Tensor | None = None  # [m, n_layers·H] context features not yet in the cache

    @staticmethod
    def _siblings(tree: StaticTree) -> list[int]:
        """Each non-root node's index among its parent's children (node order)."""
        seen: dict[int, int] = {}
        out = []
        for p in tree.parents[1:].tolist():
            out.append(seen.get(p, 0))
            seen[p] = out[-1] + 1
        return out

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([hidden[layer] for layer in self.layers], dim=-1)  # [m, n_layers·H]

    # ------------------------------------------------------------------ protocol
    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.cache = LayerCaches(len(self.draft.layers), max(512, 2 * int(prompt_ids.numel())))
        self.committed = 0
        self._pending = self._features(hidden)

    @torch.no_grad()
    def propose(self, root: int, sampling: Any, generator: Any) -> DraftTree:
        self._commit()
        # the whole block, as training scores it: its entries attend to each other, so a shorter one would change
        # the distributions of the positions drafted
        n, c = self.draft.config.block_size, self.committed
        dev = self.device
        ids = torch.full((1, n), int(root), dtype=torch.long, device=dev)
        is_mask = torch.arange(n, device=dev)[None] > 0  # [1, n]: entry 0 is the root
        x = self.draft.block(ids, is_mask)  # [1, n, H]
        h = self.draft.run_block(x, torch.arange(c, c + n, device=dev)[None], self.cache)[0, 1:self.k + 1]  # [k, H]
        logits = self.draft.logits(h).float()  # [k, out_vocab]: V, or DV with a draft vocabulary
        probs = None
        if sampling is None:
            cands = logits.topk(self.topk, dim=-1).indices  # [k, topk] best first
            drafted = self.draft.to_target(cands.reshape(-1)[self._rank_at.to(dev)])
        else:
            q = torch.stack([apply_sampling(z, float(sampling.get("temperature", 1.0)),
                                            float(sampling.get("top_p", 1.0)), int(sampling.get("top_k", 0)))
                             for z in logits])  # [k, out_vocab]
            if self.draft.config.draft_vocab_size:  # as a distribution over target ids: 0 outside the vocabulary
                q = q.new_zeros(q.shape[0], self.draft.config.vocab_size).index_copy_(1, self.draft.target_ids(), q)
            qs = q if generator is None or generator.device == q.device else q.to(generator.device)
            draws = gumbel_topk(qs, self.topk, generator)  # [k, topk] sequential draws without replacement
            drafted = draws.reshape(-1)[self._draw_at.to(draws.device)].to(dev)
            probs = torch.cat([torch.zeros_like(q[:1]), q[self._depths[1:].to(dev) - 1]]).cpu()  # row 0: the root
        tokens = torch.cat([torch.tensor([int(root)]), drafted.cpu()])
        return DraftTree(tokens, self._parents, probs, self._depths, self._mask)

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: dict[int, torch.Tensor]) -> None:
        self._pending = self._features(hidden)  # [len(path), ...]: the root and the accepted drafts

    def _commit(self) -> None:
        """Run the pending context entries into the cache (causal among themselves)."""
        assert self._pending is not None and self.cache is not None, "begin() was not called"
        m, c = self._pending.shape[0], self.committed
        if m:
            dev = self.device
            x = self.draft.context(self._pending.to(dev)[None])  # [1, m, H]
            pos = torch.arange(c, c + m, device=dev)[None]
            self.draft.commit(x, pos, self.cache)
            self.committed += m
        self._pending = self._pending[:0]


def gumbel_topk(q: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """[P, V] distributions -> [P, k] ids: k draws per row without replacement, in draw order.

    Why Gumbel: the top k of log q + Gumbel noise are distributed as k sequential draws, each from q without the
    earlier ones (Gumbel-max, applied again after removing the maximum); one call instead of k renormalisations."""
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64).clamp_(1e-300, 1.0)
    keys = q.double().log() - (-u.log()).log()  # log q + Gumbel(0, 1); -inf where q = 0
    return keys.topk(k, dim=-1).indices


def build_block_drafter(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                        allow_target_mismatch: bool = False) -> tuple[BlockDrafter, dict[str, Any]]:
    """A block draft from ``head``: ``tree.kind=chain`` drafts a chain of ``tree.depth`` tokens (null: the whole
    block); ``static`` and ``auto`` a static tree over block positions: ``tree.paths``, else ``tree.size`` nodes
    tuned to the per-rank accuracies the checkpoint recorded on held-out greedy paths (as Medusa's)."""
    kind = tree_cfg.get("kind") or "auto"
    if kind not in ("auto", "chain", "static"):
        raise ValueError(f"a block draft proposes a chain or a static tree over its positions; got tree.kind={kind!r} "
                         "(use auto, chain or static)")
    if not head:
        raise ValueError("drafter=block needs checkpoint=<head dir>")
    draft = BlockDraft.from_pretrained(head, target, allow_target_mismatch).to(target.device)
    from draftheads.heads.job import config_int

    most = draft.config.block_size - 1
    desc: dict[str, Any] = {"drafter": "block", "head": head, "block_size": draft.config.block_size}
    if kind == "chain":
        if tree_cfg.get("paths"):
            raise ValueError("tree.paths gives a static tree; with tree.kind=chain set tree.depth instead")
        drafter = BlockDrafter(draft, min(config_int(tree_cfg, "depth", most, 1, "tree"), most), dtype)
    else:
        tree, desc["tree_source"] = ranked_static_tree(tree_cfg, most, read_head_config(head).get("rank_accuracy"))
        drafter = BlockDrafter(draft, dtype=dtype, tree=tree)
    return drafter, {**desc, "tree_size": drafter.tree.size, "tree_depth": drafter.k}
