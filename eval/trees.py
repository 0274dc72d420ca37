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
from typing import Callable, Sequence

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
    heap: list[tuple[float, Path]] = [(-acc[0][r], (r,)) for r in range(len(acc[0])) if acc[0][r] >= 0]
    heapq.heapify(heap)
    chosen: list[Path] = []
    while heap and len(chosen) < size - 1:
        negv, p = heapq.heappop(heap)
        chosen.append(p)
        d = len(p)
        if d < len(acc):
            for r in range(len(acc[d])):
                if acc[d][r] >= 0:
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


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic trees
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DynamicTree:
    """A tree grown from the drafter's own confidence; nodes in breadth-first order (parents first)."""

    tokens: torch.Tensor  # [N] long, tokens[0] = root
    parents: torch.Tensor  # [N] long, parents[0] = -1
    depths: torch.Tensor  # [N] long
    scores: torch.Tensor  # [N] float, cumulative draft log-probability of the path (root 0)
    candidates: tuple[int, ...]  # candidate id (in expansion order) of every node, for the caller's bookkeeping


ChildrenFn = Callable[[list[int], list[int], list[int], list[int]], tuple[torch.Tensor, torch.Tensor]]


def dynamic_tree(root: int, children: ChildrenFn, top_k: int = 10, depth: int = 6, nodes: int = 60) -> DynamicTree:
    """EAGLE-2's tree: expand the best ``top_k`` nodes per depth, keep the best ``nodes`` overall.

    Candidates are numbered in creation order (0 = root). ``children(frontier, tokens, parents, depths)``
    gets the candidate ids to expand plus the candidate lists so far and returns ``(tokens [F, k],
    logprobs [F, k])``: each frontier node's k most likely next tokens, best first. A candidate's score
    is the sum of log-probabilities along its path (the draft's estimate of the chance that the whole
    path is accepted). Depth 1 expands the root; depth d+1 expands the ``top_k`` best depth-d candidates.
    Finally the ``nodes`` best candidates (root excluded) are kept. Log-probabilities are ≤ 0, so a
    child never outscores its parent, and ties go to the shallower, earlier candidate: the kept set is
    closed under taking parents, i.e. it is a tree.
    """
    if top_k < 1 or depth < 1 or nodes < 1:
        raise ValueError(f"dynamic tree needs top_k, depth and nodes >= 1, got {top_k}, {depth}, {nodes}")
    tokens, parents, depths, scores = [int(root)], [-1], [0], [0.0]
    frontier = [0]
    for d in range(1, depth + 1):
        tok, lp = children(frontier, tokens, parents, depths)  # [F, k]
        assert tok.shape == lp.shape and tok.shape[0] == len(frontier), (tok.shape, lp.shape, len(frontier))
        tok_l, lp_l = tok.tolist(), lp.double().tolist()
        new = []
        for i, f in enumerate(frontier):
            for t, v in zip(tok_l[i], lp_l[i]):
                new.append(len(tokens))
                tokens.append(int(t))
                parents.append(f)
                depths.append(d)
                scores.append(scores[f] + min(float(v), 0.0))
        if d == depth or not new:
            break
        frontier = sorted(new, key=lambda c: (-scores[c], c))[:top_k]
    order = sorted(range(1, len(tokens)), key=lambda c: (-scores[c], depths[c], c))[:nodes]
    kept = [0] + sorted(order, key=lambda c: (depths[c], c))  # breadth-first, siblings best first
    index = {c: i for i, c in enumerate(kept)}
    for c in kept[1:]:
        assert parents[c] in index, "kept set not closed under parents"
    return DynamicTree(
        tokens=torch.tensor([tokens[c] for c in kept], dtype=torch.long),
        parents=torch.tensor([-1] + [index[parents[c]] for c in kept[1:]], dtype=torch.long),
        depths=torch.tensor([depths[c] for c in kept], dtype=torch.long),
        scores=torch.tensor([scores[c] for c in kept], dtype=torch.float64),
        candidates=tuple(kept))


def tree_inputs(parents: torch.Tensor, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification inputs for a tree on top of ``prefix_len`` cached tokens.

    Returns the attention mask [N, prefix_len + N] (True = attend: the whole prefix, then the node's
    ancestors and itself) and position ids [N] = prefix_len + depth. This is what
    eval.generate.generate feeds the target for a tree step.
    """
    n = int(parents.numel())
    full = torch.ones(n, prefix_len + n, dtype=torch.bool)
    full[:, prefix_len:] = ancestor_mask(parents)
    return full, prefix_len + depths_of(parents)


# --------------------------------------------------------------------------------------------
# Expected tokens per step from per-depth, per-rank acceptance tables (tree=auto)
# --------------------------------------------------------------------------------------------

def node_probabilities(parents: torch.Tensor, depths: torch.Tensor, ranks: torch.Tensor,
                       table: torch.Tensor) -> torch.Tensor:
    """P(node i lies on the accepted path) under a conditional acceptance table; root = 1.

    ``table[d-1, r]`` = P(the target's token at depth d is its parent's rank-r child | the parent was
    accepted) — the per-depth, per-rank acceptance that eval/autotree.py measures. Ranks are independent
    across depths given acceptance, so a node's probability is the product along its path. Nodes past
    the table's depth or rank range get 0 (never observed, never counted on).
    """
    D, R = table.shape  # [D, R]
    t = torch.zeros(D + 1, R + 1, dtype=torch.float64)  # row 0 = root, last column = out of range (0)
    t[1:, :R] = table.to(torch.float64)
    t[0, :] = 1.0
    d = depths.clamp(0, D + 1)
    r = torch.where((ranks >= 0) & (ranks < R), ranks, torch.full_like(ranks, R))
    step = torch.where(depths <= D, t[d.clamp(max=D), r], torch.zeros((), dtype=torch.float64))  # [N]
    step[depths == 0] = 1.0
    p = step.clone()  # [N]
    for d in range(1, int(depths.max()) + 1 if depths.numel() else 0):  # parents sit one level up: already final
        lvl = depths == d
        p[lvl] = step[lvl] * p[parents[lvl]]
    return p


def expected_tokens(parents: torch.Tensor, depths: torch.Tensor, ranks: torch.Tensor, table: torch.Tensor) -> float:
    """E[accepted + 1 | tree]: Σ over nodes of P(node accepted), the root counting 1 (the target's own token).

    A chain with table[:, 0] = α gives (1 − α^(k+1)) / (1 − α); tests check trees against brute-force
    enumeration of every rank outcome.
    """
    return float(node_probabilities(parents, depths, ranks, table).sum())


def greedy_tree_order(table: torch.Tensor, max_nodes: int, max_depth: int | None = None, top_k: int | None = None,
                      expand_per_depth: int | None = None, rank_closed: bool = True) -> tuple[list[Path], list[float]]:
    """Rank paths in the order a best-first search adds them, with each node's acceptance probability.

    The first n paths form the n+1-node tree with the highest E[accepted + 1] under ``table`` (paths
    only lose value as they grow, so best-first is optimal without the expansion limit, and with
    ``rank_closed`` when the table decreases in rank). Constraints
    mirror the drafters: ``max_depth``; ``top_k`` children per node; ``rank_closed``: rank r only after
    rank r-1 (a dynamic tree keeps a best-first prefix of each node's children; a static Medusa tree may
    skip ranks); ``expand_per_depth`` = most nodes per depth that get children (EAGLE-2 expands the best
    top_k per depth). Zero-value nodes are never added.
    """
    D, R = table.shape
    D = min(D, max_depth) if max_depth is not None else D
    R = min(R, top_k) if top_k is not None else R
    t = table.tolist()
    heap: list[tuple[float, int, Path]] = []
    tie = 0

    def push(path: Path, value: float) -> None:
        nonlocal tie
        if value > 0:
            heapq.heappush(heap, (-value, tie, path))
            tie += 1

    def push_children(p: Path, v: float) -> None:  # rank 0 only, or every rank at once
        for r in range(1 if rank_closed else R):
            push(p + (r,), v * float(t[len(p)][r]))

    if D >= 1 and R >= 1:
        push_children((), 1.0)
    value: dict[Path, float] = {(): 1.0}
    expanded: dict[int, set[Path]] = {}
    order: list[Path] = []
    probs: list[float] = []
    while heap and len(order) < max_nodes:
        negv, _, p = heapq.heappop(heap)
        parent, d = p[:-1], len(p)
        if expand_per_depth is not None and parent not in expanded.get(d - 1, set()):
            if len(expanded.get(d - 1, set())) >= expand_per_depth and d > 1:
                continue  # the parent's depth already expanded its quota of nodes
        expanded.setdefault(d - 1, set()).add(parent)
        order.append(p)
        probs.append(-negv)
        value[p] = -negv
        if rank_closed and p[-1] + 1 < R:  # next sibling
            push(parent + (p[-1] + 1,), value[parent] * float(t[d - 1][p[-1] + 1]))
        if d < D:
            push_children(p, -negv)
    return order, probs
