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

from draftheads.eval import tree_masks
from draftheads.eval.tree_masks import attention_windows  # noqa: F401  (re-exported: callers read it here)
from draftheads.eval.trees import ancestor_mask, depths_of
from draftheads.eval.verify import apply_sampling, verify_tree
from draftheads.heads.target import FrozenTarget, softcap


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long, tokens[0] = root
    parents: torch.Tensor  # [N] long, parents[0] = -1
    draft_probs: torch.Tensor | None = None  # [N, V] drafter distribution each node was sampled from
    depths: torch.Tensor | None = None  # [N] (computed when None)
    mask: torch.Tensor | None = None  # [N, N] ancestor mask (computed when None)
    prefetch: list[int] | None = None  # nodes whose target logits go through the lm_head at once (None: first choices)


class Drafter(Protocol):
    """A guesser: Medusa heads, EAGLE drafts, prompt lookup, a small draft model, or nothing."""

    layers: tuple[int, ...]  # target hidden-state layers this drafter needs (see heads.target)

    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """After the prefill: prompt ids [T] and the target's hidden states {layer: [T, H]}."""

    def propose(self, root: int, sampling: dict[str, Any] | None, generator: torch.Generator | None) -> DraftTree:
        """A tree whose root is ``root`` (the last accepted token, not yet in the target's cache).

        ``sampling`` is None in greedy mode; otherwise {temperature, top_p, top_k}, which a drafter that
        *samples* children must apply to its own logits (eval.verify.apply_sampling) and return the
        distributions in ``draft_probs``. Drafters that pick children deterministically (top-k, lookup)
        return ``draft_probs=None`` in every mode; exact verification handles both.
        """

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
    tree_depths: list[int] = field(default_factory=list)  # deepest drafted node per step (0 = nothing drafted)
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


def _cache_tensors(cache: Any) -> list[tuple[Any, str, int | None]]:
    """(owner, attribute, index) of every key/value tensor in a transformers cache (new and old layouts)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer, a, None) for layer in layers for a in ("keys", "values")]
    return [(lst, "", i) for lst in (cache.key_cache, cache.value_cache) for i in range(len(lst))]


def _get(owner: Any, attr: str, i: int | None) -> torch.Tensor:
    return owner[i] if i is not None else getattr(owner, attr)


def _set(owner: Any, attr: str, i: int | None, t: torch.Tensor) -> None:
    if i is not None:
        owner[i] = t
    else:
        setattr(owner, attr, t)


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions: a view per layer, no copy (the next append copies anyway)."""
    for owner, attr, i in _cache_tensors(cache):
        _set(owner, attr, i, _get(owner, attr, i)[..., :length, :])


def commit_tree_path(cache: Any, cur: int, path: Sequence[int]) -> None:
    """After a tree forward on top of ``cur`` cached tokens, keep the prefix plus tree nodes ``path``.

    Moves only the len(path) accepted entries into place (in-place, per layer) and crops with a view:
    O(path) work per step instead of re-gathering the whole [cur + N] cache with index_select.
    """
    m = len(path)
    if any(p != j for j, p in enumerate(path)):  # not a prefix of the node order: move entries down
        src = None
        for owner, attr, i in _cache_tensors(cache):
            t = _get(owner, attr, i)
            if src is None:
                src = torch.tensor(list(path), device=t.device) + cur
            t[..., cur:cur + m, :] = t.index_select(-2, src)  # index_select gathers first: no aliasing
    crop_cache(cache, cur + m)


class _RowsOnDemand:
    """The little of a [N, V] tensor verification uses (``dim``, ``len``, ``rows[i]``), rows made when first read."""

    shape: torch.Size

    def dim(self) -> int:
        return 2

    def is_floating_point(self) -> bool:
        return True

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """All rows as one [N, V] tensor (tests)."""
        return torch.stack([self[i] for i in range(len(self))])


class LazySampledProbs(_RowsOnDemand):
    """Target sampling distributions [N, V] computed row by row, on demand.

    verify_tree reads only the root's row and the rows of accepted nodes (it indexes ``probs[i]``),
    so processing all N rows of a 64-node tree (float copy, softmax, a top-p sort per row) would be
    mostly wasted work on the critical path: ~18 ms per step at V=49k for softmax alone on this CPU.
    ``sampling=None`` (greedy) gives the raw logits row as float32: argmax over a bf16 row of 49k
    entries takes ~0.45 ms on this CPU, converting first and then argmax ~0.1 ms.
    """

    def __init__(self, logits: torch.Tensor, sampling: dict[str, Any] | None):
        self.logits = logits  # [N, V] raw target logits
        s = sampling or {}
        self._greedy = sampling is None
        self._args = (float(s.get("temperature", 1.0)), float(s.get("top_p", 1.0)), int(s.get("top_k", 0)))
        self.shape = logits.shape
        self.dtype = torch.float32
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i)
        if i not in self._rows:
            row = self.logits[i]
            self._rows[i] = row.float() if self._greedy else apply_sampling(row, *self._args)  # [V] float32
        return self._rows[i]


class LazyLogitRows(_RowsOnDemand):
    """Target logits [N, V] of a tree forward whose rows go through the lm_head only when first read.

    Verification reads the root's row and the rows of accepted nodes only (every rule walks down one
    path), yet the lm_head over all N nodes is the costliest single product of a wide tree forward on
    a CPU: [64, H] x [H, 49k] took ~3x a one-row pass here. ``prefetch`` rows (the drafter's
    first-choice chain, the likeliest accepted path) go through in one product. A row read outside it
    brings its own first-choice chain below it (``parents``) in one more product: the walk goes on down
    that chain when it goes on at all, and for a large vocabulary a pass over a few rows costs far less
    than a pass per row, since each pass reads the whole weight (Gemma 3's 262k x 640 lm_head on 2
    cores: 20.6 ms for one row and 25.8 for eight in bf16, 55 and 99 ms in fp32;
    scripts/bench_verify_cost.py). A row is the same product as in the full pass, so greedy results
    are unchanged.
    """

    def __init__(self, hidden: torch.Tensor, lm_head: torch.nn.Module, prefetch: Sequence[int] = (),
                 cap: float | None = None, parents: torch.Tensor | None = None):
        """``cap``: the target's final logit softcap (FrozenTarget.logit_softcap), applied to every row.
        ``parents`` [N]: the tree, so that a row read outside ``prefetch`` brings its first-choice chain."""
        self.hidden = hidden  # [N, H] final-normed last hidden states
        self.lm_head = lambda h: softcap(lm_head(h), cap)
        self.shape = torch.Size((hidden.shape[0], lm_head.weight.shape[0]))
        self.dtype = lm_head.weight.dtype
        self.computed = 0  # rows that went through the lm_head (tests, benchmarks)
        self.passes = 0  # lm_head products (each reads the whole weight)
        self.seconds = 0.0  # time spent on rows computed after construction (the loop counts it as target time)
        self._parents = parents
        self._rows: dict[int, torch.Tensor] = {}
        if prefetch:
            self._compute(list(prefetch))

    def _compute(self, idx: list[int]) -> None:
        out = self.lm_head(self.hidden[torch.tensor(idx, device=self.hidden.device)])  # [P, V]
        self._rows.update((i, out[j]) for j, i in enumerate(idx))
        self.computed += len(idx)
        self.passes += 1

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i)
        if i not in self._rows:
            t0 = _clock(self.hidden.device)
            chain = [i] if self._parents is None else first_choice_chain(self._parents, start=i)
            self._compute([j for j in chain if j not in self._rows])
            self.seconds += _clock(self.hidden.device) - t0
        return self._rows[i]


def first_choice_chain(parents: torch.Tensor, start: int = 0) -> list[int]:
    """``start`` (the root by default), its first child, that child's first child, ...: the path a drafter ranks
    best below ``start`` (siblings best first)."""
    first: dict[int, int] = {}
    for j, p in enumerate(parents.tolist()):
        if p >= 0 and p not in first:
            first[p] = j
    chain = [int(start)]
    while chain[-1] in first:
        chain.append(first[chain[-1]])
    return chain


def _target_dist(logits: torch.Tensor, mode: str, sampling: dict[str, Any] | None) -> LazySampledProbs:
    """Rows for verify_tree: raw float logits in greedy mode (argmax only), else processed distributions."""
    return LazySampledProbs(logits, None if mode == "greedy" else (sampling or {}))


def _clock(dev: torch.device) -> float:
    """perf_counter after the device has finished (CUDA kernels are asynchronous)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def tree_forward(target: FrozenTarget, tokens: torch.Tensor, mask: torch.Tensor | None, depths: torch.Tensor,
                 cur: int, cache: Any, layers: Sequence[int] = (), logits: bool = True) -> dict[str, Any]:
    """One verification forward of N tree nodes on top of ``cur`` cached tokens (the loop's only target call).

    tokens [N]; mask [N, N] ancestor mask (None for a single node: the plain causal path); depths [N].
    Positions are cur + depth; every node attends to the whole prefix and to its ancestors. Shared with
    eval.measure's latency profile. ``logits=False`` skips the lm_head (the loop then reads rows lazily,
    :class:`LazyLogitRows`); ``last_hidden`` [1, N, H] is returned either way.
    """
    dev = target.device
    n = int(tokens.numel())
    if n == 1:  # plain step: the usual causal path, no custom mask
        return target(tokens.view(1, 1).to(dev), cache=cache, layers=layers,
                      position_ids=torch.tensor([[cur]], device=dev), logits=logits)
    depths = depths.to(dev)
    full = torch.ones(n, cur + n, dtype=torch.bool, device=dev)  # [N, cur+N]: prefix, then ancestors
    full[:, cur:] = mask.to(dev)
    amask = tree_masks.layer_masks(full, depths, cur, target)  # cut to each layer type's window
    return target(tokens.view(1, n).to(dev), cache=cache, layers=layers, attention_mask=amask,
                  position_ids=(cur + depths).view(1, n), logits=logits)


@torch.no_grad()
def generate(target: FrozenTarget, drafter: Any, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
             eos_ids: Sequence[int] = (), mode: str = "greedy", sampling: dict[str, Any] | None = None,
             generator: torch.Generator | None = None, max_length: int | None = None) -> GenResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with speculative steps proposed by ``drafter``.

    ``mode``: greedy | exact | typical (see eval.verify); ``sampling`` {temperature, top_p, top_k} is
    applied to the target's logits in the sampled modes and handed to the drafter (None in greedy mode).
    Timing: ``target_seconds`` = target forwards, ``draft_seconds`` = drafter calls, ``prefill_seconds``
    = prompt forward + drafter.begin; the rest (mask, verification, cache compaction) is bookkeeping.
    """
    dev = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).view(-1)
    eos = set(int(e) for e in eos_ids)
    max_len = max_length or getattr(target.config, "max_position_embeddings", 1 << 30)
    draft_sampling = None if mode == "greedy" else (sampling or {})
    res = GenResult(tokens=[])
    t_start = _clock(dev)
    cache = target.new_cache()
    layers = tuple(getattr(drafter, "layers", ()))

    out = target(prompt[None], cache=cache, layers=layers, logits=torch.tensor([[False] * (len(prompt) - 1) + [True]],
                                                                                  device=dev))
    dist = _target_dist(out["logits"], mode, sampling)  # [1, V]
    if mode == "greedy":
        root = int(dist[0].argmax())
    else:
        p0 = dist[0].float()
        root = int(torch.multinomial(p0 if generator is None else p0.to(generator.device), 1, generator=generator))
    drafter.begin(prompt, {l: h[0] for l, h in out["hidden"].items()})
    res.prefill_seconds = _clock(dev) - t_start
    res.tokens.append(root)
    cur = len(prompt)  # tokens in the cache
    if root in eos:
        res.stopped = "eos"
    while res.stopped == "max_new_tokens" and len(res.tokens) < max_new_tokens:
        if cur + 1 >= max_len:
            res.stopped = "max_length"
            break
        t0 = _clock(dev)
        tree = drafter.propose(root, draft_sampling, generator)
        res.draft_seconds += _clock(dev) - t0
        tree = _prune_to_fit(tree, max_len - cur)
        n = int(tree.tokens.numel())
        depths = tree.depths if tree.depths is not None else depths_of(tree.parents)
        amask = None if n == 1 else (tree.mask if tree.mask is not None else ancestor_mask(tree.parents))
        t1 = _clock(dev)
        out = tree_forward(target, tree.tokens, amask, depths, cur, cache, layers, logits=n == 1)
        logits = out["logits"][0] if n == 1 else LazyLogitRows(
            out["last_hidden"][0], target.lm_head(),
            tree.prefetch if tree.prefetch is not None else first_choice_chain(tree.parents),
            target.logit_softcap, tree.parents)  # [N, V], rows on demand
        res.target_seconds += _clock(dev) - t1
        dist = _target_dist(logits, mode, sampling)  # [N, V] (rows computed on demand)
        accepted, nxt = verify_tree(tree.tokens, tree.parents, dist, tree.draft_probs, mode=mode, generator=generator)
        if isinstance(logits, LazyLogitRows):
            res.target_seconds += logits.seconds  # rows the rule read beyond the prefetch are target work
        path = [0] + list(accepted)
        if n > 1:
            commit_tree_path(cache, cur, path)
        cur += len(path)
        new = [int(tree.tokens[i]) for i in accepted] + [int(nxt)]
        res.accepted.append(len(accepted))
        res.tree_sizes.append(n)
        res.tree_depths.append(int(depths.max()) if n > 1 else 0)
        t2 = _clock(dev)
        drafter.accept(tree, path, int(nxt), {l: h[0, path] for l, h in out["hidden"].items()})
        res.draft_seconds += _clock(dev) - t2
        for tok in new:
            res.tokens.append(tok)
            if tok in eos:
                res.stopped = "eos"
                break
            if len(res.tokens) >= max_new_tokens:
                break
        root = int(nxt)
    res.tokens = res.tokens[:max_new_tokens]
    res.seconds = _clock(dev) - t_start
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
