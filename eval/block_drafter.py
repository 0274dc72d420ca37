"""Block drafting for the generation loop: one draft forward proposes a chain of up to ``block_size - 1`` tokens.

With a draft vocabulary the draft's distributions are over its own ids; they are mapped to target ids (zero
outside the vocabulary) before drafting, so q is what the exact rule reads.

Bookkeeping (cur = tokens in the target's cache; the root x_cur is the last accepted token):

* The draft's cache holds one *committed* context entry per position t < cur, made from the target's hidden
  states at t. After the prefill those are positions 0..cur-1; after a step, the target's hidden states of the
  root and the accepted drafts arrive through ``accept`` and are committed on the next ``propose``.
* ``propose`` commits the pending context entries (prefix layout: run causally through the layers; kv layout:
  only projected to each layer's keys and values), then runs the block
  [root, mask, ..., mask] at positions cur..cur+n; block entries attend to all committed entries and to each
  other. Entry j >= 1 gives the draft's distribution of the token j places after the root. The block's keys
  and values are dropped again, so the cache always equals a fresh prefill of the accepted text's context.
* Greedy: each position's argmax. Sampling: each position is drawn from its own distribution q_j (the draft
  conditions on no drafted token, so q_j is exactly what x_j was drawn from) and returned in ``draft_probs``, so
  the exact rule min(1, p/q) with residual max(0, p - q) keeps the target's distribution.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from draftheads.eval.draft_cache import DraftKVCache
from draftheads.eval.generate import DraftTree
from draftheads.eval.shapes import ChainShape
from draftheads.eval.trees import ancestor_mask, chain
from draftheads.eval.verify import apply_sampling
from draftheads.heads.block import BlockDraft
from draftheads.heads.target import FrozenTarget


# A chain of tree.depth tokens (clipped to the block); one forward drafts any length, so one short chain is timed.
# Branchable: tree.lookup_branch hangs a prompt-lookup chain beside it (accept reads only the accepted tokens' hidden
# states, whichever branch they came from)
SHAPE = ChainShape("depth", probe_len=15, timed=(1,), section="tree", branchable=True)


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
    """Drafter protocol (eval.generate) for a block draft: a chain of ``tokens`` drafts from one forward."""

    def __init__(self, draft: BlockDraft, tokens: int | None = None, dtype: torch.dtype | None = None):
        self.draft = draft.eval()
        if dtype is not None:
            self.draft.cast(dtype)
        most = draft.config.block_size - 1
        self.k = most if tokens is None else int(tokens)
        if not 1 <= self.k <= most:
            raise ValueError(f"tree.depth={tokens}: this block draft proposes 1..{most} tokens per step "
                             f"(block_size {draft.config.block_size})")
        self.layers = tuple(draft.config.context_layers)  # what generate() must hand us from the target
        c = chain(self.k)
        self._parents, self._depths = c.parents, c.depths
        self._mask = ancestor_mask(c.parents)
        self.cache: LayerCaches | None = None
        self.committed = 0
        self._pending: torch.Tensor | None = None  # [m, n_layers·H] context features not yet in the cache

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
        n, c = self.k + 1, self.committed
        dev = self.device
        ids = torch.full((1, n), int(root), dtype=torch.long, device=dev)
        is_mask = torch.arange(n, device=dev)[None] > 0  # [1, n]: entry 0 is the root
        x = self.draft.block(ids, is_mask)  # [1, n, H]
        h = self.draft.run_block(x, torch.arange(c, c + n, device=dev)[None], self.cache)[0, 1:]  # [k, H]
        logits = self.draft.logits(h).float()  # [k, out_vocab]: V, or DV with a draft vocabulary
        probs = None
        if sampling is None:
            drafted = self.draft.to_target(logits.argmax(-1))
        else:
            q = torch.stack([apply_sampling(z, float(sampling.get("temperature", 1.0)),
                                            float(sampling.get("top_p", 1.0)), int(sampling.get("top_k", 0)))
                             for z in logits])  # [k, out_vocab]
            if self.draft.config.draft_vocab_size:  # as a distribution over target ids: 0 outside the vocabulary
                q = q.new_zeros(q.shape[0], self.draft.config.vocab_size).index_copy_(1, self.draft.target_ids(), q)
            qs = q if generator is None or generator.device == q.device else q.to(generator.device)
            drafted = torch.multinomial(qs, 1, generator=generator)[:, 0].to(dev)
            probs = torch.cat([torch.zeros_like(q[:1]), q]).cpu()  # row 0 (the root) unused
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


def build_block_drafter(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                        allow_target_mismatch: bool = False) -> tuple[BlockDrafter, dict[str, Any]]:
    """A block draft from ``head``; ``tree.depth`` drafted tokens per step (null: the whole block)."""
    if (tree_cfg.get("kind") or "auto") not in ("auto", "chain"):
        raise ValueError(f"a block draft proposes a chain; got tree.kind={tree_cfg.get('kind')!r} (use auto or chain)")
    if not head:
        raise ValueError("drafter=block needs checkpoint=<head dir>")
    draft = BlockDraft.from_pretrained(head, target, allow_target_mismatch).to(target.device)
    from draftheads.heads.job import config_int

    most = draft.config.block_size - 1
    depth = min(config_int(tree_cfg, "depth", most, 1, "tree"), most)
    drafter = BlockDrafter(draft, depth, dtype)
    return drafter, {"drafter": "block", "head": head, "tree_size": drafter.k + 1, "tree_depth": drafter.k,
                     "block_size": draft.config.block_size}
