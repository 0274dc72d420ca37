"""Speculative generation (batch 1) for any drafter, and plain decoding through the same code path.

One step: the drafter proposes a tree rooted at the last accepted token; the target scores every
node in one forward (tree attention mask, positions = prefix length + depth); ``verify_tree`` picks
the accepted path and the target's own next token; the KV cache keeps only the root and the
accepted path; the drafter is told what was accepted. τ counts (accepted + 1) per verification step.

Batch > 1 would need per-row trees of different sizes padded to one width, per-row accepted
lengths (ragged caches: a cache that supports per-row lengths or re-padding after each step), and
per-row EOS bookkeeping; this loop is for latency measurement at batch 1, where speculation pays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from eval.trees import ancestor_mask, depths_of
from eval.verify import apply_sampling, verify_tree
from heads.target import FrozenTarget


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long, tokens[0] = root
    parents: torch.Tensor  # [N] long, parents[0] = -1
    draft_probs: torch.Tensor | None = None  # [N, V] drafter distribution each node was sampled from
    depths: torch.Tensor | None = None  # [N] (computed when None)
    mask: torch.Tensor | None = None  # [N, N] ancestor mask (computed when None)


class Drafter(Protocol):
    """A guesser: Medusa heads, EAGLE drafts, prompt lookup, a small draft model, or nothing."""

    layers: tuple[int, ...]  # target hidden-state layers this drafter needs (see heads.target)

    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """After the prefill: prompt ids [T] and the target's hidden states {layer: [T, H]}."""

    def propose(self, root: int, sampling: dict[str, Any] | None, generator: torch.Generator | None) -> DraftTree:
        """A tree whose root is ``root`` (the last accepted token, not yet in the target's cache)."""

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: dict[int, torch.Tensor]) -> None:
        """``path`` = accepted node indices starting with the root; hidden = {layer: [len(path), H]}."""


class NoDrafter:
    """Plain decoding: a tree that is just the root."""

    layers: tuple[int, ...] = ()

    def begin(self, prompt_ids, hidden) -> None:
        pass

    def propose(self, root, sampling, generator) -> DraftTree:
        return DraftTree(torch.tensor([root]), torch.tensor([-1]))

    def accept(self, tree, path, next_token, hidden) -> None:
        pass


@dataclass
class GenResult:
    tokens: list[int]  # generated token ids (after the prompt), EOS included if produced
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verification step
    tree_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    stopped: str = "max_new_tokens"  # eos | max_new_tokens | max_length

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))

    @property
    def bookkeeping_seconds(self) -> float:
        return self.seconds - self.target_seconds - self.draft_seconds - self.prefill_seconds


def keep_cache_positions(cache: Any, keep: torch.Tensor) -> None:
    """Keep only sequence positions ``keep`` (sorted, [M]) in every layer of a transformers cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        return
    for i in range(len(cache.key_cache)):  # older transformers
        cache.key_cache[i] = cache.key_cache[i].index_select(-2, keep)
        cache.value_cache[i] = cache.value_cache[i].index_select(-2, keep)


def _target_dist(logits: torch.Tensor, mode: str, sampling: dict[str, Any] | None) -> torch.Tensor:
    if mode == "greedy":
        return logits  # argmax only; no softmax over [N, V] needed
    s = sampling or {}
    return apply_sampling(logits.float(), s.get("temperature", 1.0), s.get("top_p", 1.0), s.get("top_k", 0))


@torch.no_grad()
def generate(target: FrozenTarget, drafter: Any, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
             eos_ids: Sequence[int] = (), mode: str = "greedy", sampling: dict[str, Any] | None = None,
             generator: torch.Generator | None = None, max_length: int | None = None) -> GenResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with speculative steps proposed by ``drafter``."""
    dev = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).view(-1)
    eos = set(int(e) for e in eos_ids)
    max_len = max_length or getattr(target.config, "max_position_embeddings", 1 << 30)
    res = GenResult(tokens=[])
    t_start = time.perf_counter()
    cache = target.new_cache()
    layers = tuple(getattr(drafter, "layers", ()))

    out = target(prompt[None], cache=cache, layers=layers, logits=torch.tensor([[False] * (len(prompt) - 1) + [True]],
                                                                                  device=dev))
    dist = _target_dist(out["logits"], mode, sampling)  # [1, V]
    if mode == "greedy":
        root = int(dist[0].argmax())
    else:
        root = int(torch.multinomial(dist[0].float(), 1, generator=generator))
    drafter.begin(prompt, {l: h[0] for l, h in out["hidden"].items()})
    res.prefill_seconds = time.perf_counter() - t_start
    res.tokens.append(root)
    cur = len(prompt)  # tokens in the cache
    if root in eos:
        res.stopped = "eos"
    while res.stopped == "max_new_tokens" and len(res.tokens) < max_new_tokens:
        if cur + 1 >= max_len:
            res.stopped = "max_length"
            break
        t0 = time.perf_counter()
        tree = drafter.propose(root, sampling, generator)
        tree = _prune_to_fit(tree, max_len - cur)
        res.draft_seconds += time.perf_counter() - t0
        n = int(tree.tokens.numel())
        depths = tree.depths if tree.depths is not None else depths_of(tree.parents)
        amask = tree.mask if tree.mask is not None else ancestor_mask(tree.parents)
        t1 = time.perf_counter()
        if n == 1:  # plain step: the usual causal path, no custom mask
            out = target(tree.tokens.view(1, 1).to(dev), cache=cache, layers=layers,
                         position_ids=torch.tensor([[cur]], device=dev))
        else:
            full = torch.ones(n, cur + n, dtype=torch.bool, device=dev)
            full[:, cur:] = amask.to(dev)
            out = target(tree.tokens.view(1, n).to(dev), cache=cache, layers=layers, attention_mask=full[None, None],
                         position_ids=(cur + depths).view(1, n).to(dev))
        res.target_seconds += time.perf_counter() - t1
        dist = _target_dist(out["logits"][0], mode, sampling)  # [N, V]
        accepted, nxt = verify_tree(tree.tokens, tree.parents, dist, tree.draft_probs, mode=mode, generator=generator)
        path = [0] + list(accepted)
        if n > 1 and path != list(range(len(path))):
            keep = torch.cat([torch.arange(cur, device=dev), cur + torch.tensor(path, device=dev)])
            keep_cache_positions(cache, keep)
        elif n > 1:  # accepted path is a prefix of the node order: a crop suffices
            keep_cache_positions(cache, torch.arange(cur + len(path), device=dev))
        cur += len(path)
        new = [int(tree.tokens[i]) for i in accepted] + [int(nxt)]
        res.accepted.append(len(accepted))
        res.tree_sizes.append(n)
        t2 = time.perf_counter()
        drafter.accept(tree, path, int(nxt), {l: h[0, path] for l, h in out["hidden"].items()})
        res.draft_seconds += time.perf_counter() - t2
        for tok in new:
            res.tokens.append(tok)
            if tok in eos:
                res.stopped = "eos"
                break
            if len(res.tokens) >= max_new_tokens:
                break
        root = int(nxt)
    res.tokens = res.tokens[:max_new_tokens]
    res.seconds = time.perf_counter() - t_start
    return res


def _prune_to_fit(tree: DraftTree, room: int) -> DraftTree:
    """Drop nodes that would run past the model's maximum length (rare: near max_position_embeddings)."""
    depths = tree.depths if tree.depths is not None else depths_of(tree.parents)
    if int(depths.max()) < room and tree.tokens.numel() <= room:
        return tree
    keep = (depths < max(1, room - 1)).nonzero().view(-1)[: max(1, room - 1)]
    remap = {int(o): i for i, o in enumerate(keep.tolist())}
    parents = torch.tensor([-1] + [remap[int(tree.parents[o])] for o in keep.tolist()[1:]])
    return DraftTree(tree.tokens[keep], parents, None if tree.draft_probs is None else tree.draft_probs[keep])
