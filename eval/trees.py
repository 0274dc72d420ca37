"""Draft trees as plain tensors: structure, attention masks, depth positions, and tree design.

A tree of N nodes is ``parents[N]`` (node 0 = root = the last accepted token, ``parents[0] = -1``,
``parents[i] < i``) plus ``tokens[N]``. Siblings are ordered by index, which is also the order the
verifier tries them in. Static (Medusa-style) trees are given as *paths*: a path ``(r1, r2, ...)`` is the
node reached by taking candidate rank r1 at depth 1, rank r2 at depth 2, ... — e.g. ``(0, 1)`` is the
second-best depth-2 candidate under the best depth-1 candidate.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import torch

Path = tuple[int, ...]


@dataclass(frozen=True)
class StaticTree:
    """A static tree topology: node i has ``depths[i]`` and candidate rank ``ranks[i]`` at that depth."""

    paths: tuple[Path, ...]  # node i>0 is paths[i-1]; node 0 is the root ()
    parents: torch.Tensor  # [N] long
    depths: torch.Tensor  # [N] long, root depth 0
    ranks: torch.Tensor  # [N] long, rank among the candidates of its depth (root: 0)

    @property
    def size(self) -> int:
        return int(self.parents.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def max_rank(self) -> list[int]:
        """Top-k needed per depth (index d-1 for depth d)."""
        out = [0] * self.max_depth
        for p in self.paths:
            out[len(p) - 1] = max(out[len(p) - 1], p[-1] + 1)
        return out


def static_tree(paths: Sequence[Sequence[int]]) -> StaticTree:
    """Validate and order paths (by depth, then lexicographically) into a StaticTree."""
    ps = sorted({tuple(int(x) for x in p) for p in paths}, key=lambda p: (len(p), p))
    if not ps:
        raise ValueError("a tree needs at least one path")
    seen = set(ps)
    for p in ps:
        if len(p) == 0:
            raise ValueError("empty path: the root is implicit, list only its descendants")
        if any(x < 0 for x in p):
            raise ValueError(f"tree path {list(p)} has a negative rank")
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])} in the tree")
    index = {(): 0}
    parents, depths, ranks = [-1], [0], [0]
    for i, p in enumerate(ps, start=1):
        index[p] = i
        parents.append(index[p[:-1]])
        depths.append(len(p))
        ranks.append(p[-1])
    return StaticTree(tuple(ps), torch.tensor(parents), torch.tensor(depths), torch.tensor(ranks))


def chain(depth: int) -> StaticTree:
    """A single chain of top-1 candidates."""
    return static_tree([(0,) * d for d in range(1, depth + 1)])


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: mask[i, j] = j is i or an ancestor of i (what node i may attend to in the tree)."""
    n = int(parents.numel())
    m = torch.zeros(n, n, dtype=torch.bool)
    par = parents.tolist()
    for i in range(n):
        assert par[i] < i, "parents must point to earlier nodes"
        if par[i] >= 0:
            m[i] = m[par[i]]
        m[i, i] = True
    return m


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    par = parents.tolist()
    d = [0] * len(par)
    for i in range(1, len(par)):
        d[i] = d[par[i]] + 1
    return torch.tensor(d, dtype=torch.long)


def tree_from_accuracies(acc: Sequence[Sequence[float]], size: int) -> StaticTree:
    """The prefix-closed tree of ``size`` nodes (root included) with the highest expected accepted length.

    ``acc[d][r]`` = probability that the candidate of rank r at depth d+1 is the target's token
    (measured per head on held-out data). Under independence a node is accepted with the product of
    its path's probabilities, and the expected number of accepted tokens is the sum over nodes, so
    greedily adding the best frontier node is optimal (values only shrink along a path).
    """
    if size < 2:
        raise ValueError(f"tree size must be >= 2 (root + one candidate), got {size}")
    heap: list[tuple[float, Path]] = [(-acc[0][r], (r,)) for r in range(len(acc[0])) if acc[0][r] > 0]
    heapq.heapify(heap)
    chosen: list[Path] = []
    while heap and len(chosen) < size - 1:
        negv, p = heapq.heappop(heap)
        chosen.append(p)
        d = len(p)
        if d < len(acc):
            for r in range(len(acc[d])):
                if acc[d][r] > 0:
                    heapq.heappush(heap, (negv * acc[d][r], p + (r,)))
    return static_tree(chosen)


def expected_accept_length(tree: StaticTree, acc: Sequence[Sequence[float]]) -> float:
    """Σ over nodes of Π path probabilities (+1 for the target's own token): the modeled τ."""
    total = 1.0
    for p in tree.paths:
        total += math.prod(acc[d][r] if r < len(acc[d]) else 0.0 for d, r in enumerate(p))
    return total


def generic_accuracies(num_heads: int, top_k: int = 10) -> list[list[float]]:
    """A generic accuracy profile for heads with no measured statistics (drops with depth and rank)."""
    out = []
    for d in range(num_heads):
        top1 = 0.6 * (0.75 ** d)
        out.append([top1 * (0.45 ** r) for r in range(top_k)])
    return out


def default_tree(num_heads: int, size: int = 64, acc: Sequence[Sequence[float]] | None = None) -> StaticTree:
    """The default static tree: tuned to measured per-rank accuracies when given, else generic."""
    return tree_from_accuracies(acc if acc is not None else generic_accuracies(num_heads), size)
