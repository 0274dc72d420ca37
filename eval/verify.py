"""Verification rules for speculative decoding over a draft tree.

Pure functions on torch tensors, no model code: given a tree of drafted tokens
and the target's next-token distribution after every node (one target forward
pass with a tree attention mask gives all of them), decide which path the target
accepts and which token the target contributes itself.

Modes of :func:`verify_tree`:

* ``"greedy"``: follow the target's argmax. Exact for greedy (temperature 0)
  decoding: the output equals what the target alone would emit greedily.
* ``"exact"``: the multi-candidate rejection rule (SpecInfer, Miao et al. 2024;
  the without-replacement form is the "recursive rejection sampling" of Jeon et
  al. 2024). Whatever the drafter, each emitted token is an exact sample from
  the target's distribution given everything before it, so the output sequence
  is distributed exactly as the target's (see ``eval/exactness.py`` for the
  statistical check).
* ``"typical"``: Medusa's typical acceptance (Cai et al. 2024). Faster, but
  **NOT distribution-preserving**: it accepts any candidate the target finds
  plausible enough, so the output is biased toward the drafter. Use it only as a
  baseline, never where exactness is claimed.

Sampling settings (temperature, top-p, top-k) must be applied with
:func:`apply_sampling` to both the target and the draft logits *before* drafting
and verifying: the exactness guarantee is about the distributions that are
actually compared, i.e. the output is an exact sample from the processed target
distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

MODES = ("greedy", "exact", "typical")

# Medusa's defaults for typical acceptance (posterior_threshold, posterior_alpha).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3


def apply_sampling(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Turn logits [..., V] into the sampling distribution [..., V].

    Order as in Hugging Face generation: temperature, then top-k, then top-p.
    ``temperature == 0`` gives a one-hot argmax (greedy); ``top_k == 0`` and
    ``top_p == 1`` disable those filters. Apply the same settings to target and
    draft logits before :func:`verify_tree` (see module docstring).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dim, got shape {tuple(logits.shape)}")
    x = logits if logits.dtype == torch.float64 else logits.float()  # [..., V]
    if temperature == 0:
        idx = x.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)
    x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        # Keep exactly top_k entries, even with ties at the threshold.
        idx = torch.topk(x, top_k, dim=-1).indices  # [..., top_k]
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
        x = x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [..., V]
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < top_p  # smallest prefix reaching top_p; the top token is always kept
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def tree_children(parents: Sequence[int] | torch.Tensor) -> list[list[int]]:
    """Children of every node, in increasing index order (the order siblings are tried).

    ``parents[0]`` must be -1 (the root) and ``0 <= parents[i] < i`` otherwise,
    which makes the nodes a topologically ordered tree.
    """
    par = _as_int_list(parents, "parents")
    if not par:
        raise ValueError("parents is empty: a tree has at least the root")
    if par[0] != -1:
        raise ValueError(f"parents[0] must be -1 (root), got {par[0]}")
    children: list[list[int]] = [[] for _ in par]
    for i in range(1, len(par)):
        if not 0 <= par[i] < i:
            raise ValueError(f"parents[{i}] = {par[i]} is not in [0, {i}): not a valid tree")
        children[par[i]].append(i)
    return children


def verify_tree(
    tokens: torch.Tensor,
    parents: Sequence[int] | torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    mode: str = "exact",
    generator: torch.Generator | None = None,
    *,
    posterior_threshold: float = TYPICAL_EPSILON,
    posterior_alpha: float = TYPICAL_DELTA,
) -> tuple[list[int], int]:
    """Verify a draft tree against the target; return (accepted nodes, next token).

    Args:
        tokens: [N] token of every node; node 0 is the root (the last token
            already accepted), its token is not verified.
        parents: [N] parent index per node, ``parents[0] == -1``, ``parents[i] < i``.
            Siblings are tried in increasing index order.
        target_probs: [N, V] target's next-token distribution after the path
            root -> i, sampling settings already applied. Visited rows are
            renormalized in float64 (ValueError if one has no mass); entries
            are assumed non-negative (not checked, to keep this cheap).
        draft_probs: [N, V] or None. ``draft_probs[i]`` is the distribution node
            i was sampled from (the drafter's distribution at i's parent), the
            drafter having sampled siblings *without replacement in index order*;
            only the row of a node's first child is read for that sibling group.
            Row 0 is unused. ``None`` means children were chosen deterministically
            (top-k, static trees, n-gram lookup).
        mode: "greedy", "exact" or "typical" (see module docstring; "typical" is
            NOT distribution-preserving).
        generator: source of all randomness (CPU generator unless you pass one).
        posterior_threshold, posterior_alpha: epsilon and delta of typical
            acceptance; ignored by the other modes.

    Returns:
        ``accepted``: node indices of the accepted path after the root, in order
        (possibly empty); ``next_token``: the token the target contributes (the
        residual sample after a rejection, or the bonus sample at the last
        accepted node). The step emits ``tokens[accepted] + [next_token]``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    tok, children = _validate_tree(tokens, parents, target_probs, draft_probs)
    if mode == "greedy":
        return _verify_greedy(tok, children, target_probs)
    if mode == "typical":
        return _verify_typical(tok, children, target_probs, generator, posterior_threshold, posterior_alpha)
    return _verify_exact(tok, children, target_probs, draft_probs, generator)


# ---------------------------------------------------------------------------
# Modes


def _verify_greedy(tok: list[int], children: list[list[int]], target_probs: torch.Tensor) -> tuple[list[int], int]:
    """Walk the target's argmax path; the first sibling carrying the argmax wins."""
    node, accepted = 0, []
    while True:
        best = int(torch.argmax(target_probs[node]))
        nxt = next((c for c in children[node] if tok[c] == best), None)
        if nxt is None:
            return accepted, best
        accepted.append(nxt)
        node = nxt


def _verify_exact(
    tok: list[int],
    children: list[list[int]],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling (recursive, siblings without replacement).

    At a node with target distribution p and sibling candidates c_1, c_2, ...
    drafted without replacement from q: accept c_j with min(1, p(c_j)/q(c_j));
    on rejection p <- norm(max(0, p - q)) and q <- q without c_j, renormalized.
    With deterministic candidates q is one-hot, so accept with p(c_j) and on
    rejection zero p(c_j). Either way the token leaving a node (an accepted
    child's token, or a sample from the final residual) is exactly distributed
    as the target's p at that node: rejecting c_j leaves exactly the residual
    mass of p, and the next candidate is a fresh proposal for that residual.
    """
    uniforms = _uniforms(len(tok) + 1, generator)  # one per tried child, one for the final sample
    n_used = 0
    node, accepted = 0, []
    p = _prob_row(target_probs, 0, "target_probs")  # [V] float64, current residual target
    while True:
        kids = children[node]
        q = None
        if draft_probs is not None and kids:
            q = _prob_row(draft_probs, kids[0], "draft_probs")  # [V] shared by all siblings
        moved = False
        for c in kids:
            t = tok[c]
            p_t = float(p[t])
            q_t = float(q[t]) if q is not None else 0.0
            # q_t == 0 for a "sampled" child is off-contract (the drafter could not
            # have drawn it, e.g. a duplicate sibling). Treating that candidate as
            # deterministic (one-hot q) keeps the rule exact for any fixed token.
            sampled = q is not None and q_t > 0.0
            accept_prob = min(1.0, p_t / q_t) if sampled else p_t
            u = uniforms[n_used]
            n_used += 1
            if u < accept_prob:
                accepted.append(c)
                node = c
                p = _prob_row(target_probs, c, "target_probs")
                moved = True
                break
            p = _residual(p, q if sampled else None, t)
            if sampled:
                q = _remove_token(q, t)
        if not moved:
            return accepted, _sample(p, uniforms[n_used])


def _verify_typical(
    tok: list[int],
    children: list[list[int]],
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    epsilon: float,
    delta: float,
) -> tuple[list[int], int]:
    """Medusa typical acceptance: accept c if p(c) > min(epsilon, delta * exp(-H(p))).

    Descends greedily to the first accepted sibling (Medusa picks the longest
    accepted candidate path; first-accepted is the greedy-descent variant) and
    samples the bonus token from the target's p at the last accepted node. NOT
    distribution-preserving: there is no rejection correction.
    """
    uniforms = _uniforms(1, generator)
    node, accepted = 0, []
    while True:
        p = _prob_row(target_probs, node, "target_probs")  # [V]
        nz = p[p > 0]
        entropy = float(-(nz * nz.log()).sum())
        threshold = min(epsilon, delta * math.exp(-entropy))
        nxt = next((c for c in children[node] if float(p[tok[c]]) > threshold), None)
        if nxt is None:
            return accepted, _sample(p, uniforms[0])
        accepted.append(nxt)
        node = nxt


# ---------------------------------------------------------------------------
# Helpers


def _residual(p: torch.Tensor, q: torch.Tensor | None, t: int) -> torch.Tensor:
    """Target residual after rejecting token t: norm(max(0, p - q)), q=None meaning one-hot at t.

    Numerical fallback: if the residual has no mass (only possible through
    rounding, since rejection requires p(t) < q(t) and hence some p(y) > q(y)),
    use p with t zeroed, and if even that is empty, p unchanged. Both are the
    limits the exact rule approaches, and rejection has ~0 probability there.
    """
    if q is not None:
        r = torch.clamp_min(p - q, 0.0)
    else:
        r = p.clone()
        r[t] = 0.0
    mass = float(r.sum())
    if not mass > 0.0:
        r = p.clone()
        r[t] = 0.0
        mass = float(r.sum())
        if not mass > 0.0:
            return p
    return r / mass


def _remove_token(q: torch.Tensor, t: int) -> torch.Tensor:
    """Drafter distribution for the next sibling: q without token t, renormalized."""
    q = q.clone()
    q[t] = 0.0
    mass = float(q.sum())
    return q / mass if mass > 0.0 else q  # all-zero q: later siblings use the one-hot rule


def _sample(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from p [V] with a uniform u in [0, 1); never returns a zero-mass token."""
    cdf = torch.cumsum(p, dim=0)  # [V]
    idx = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    if idx >= p.shape[0] or float(p[idx]) <= 0.0:  # u * total rounded up to total
        idx = int(torch.nonzero(p > 0)[-1])
    return idx


def _uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device).tolist()


def _prob_row(probs: torch.Tensor, i: int, name: str) -> torch.Tensor:
    """Row i of a probability table as normalized float64 [V] on the CPU; ValueError if it has no mass.

    The CPU because the target's rows may live on a GPU and a drafter's on the CPU: the rule's few
    row operations per step then never mix devices, and float64 keeps the residuals exact."""
    row = probs[i].to("cpu", torch.float64)
    mass = float(row.sum())
    if not (mass > 0.0 and math.isfinite(mass)):
        raise ValueError(f"{name}[{i}] is not a distribution (sum = {mass})")
    return row / mass


def _as_int_list(x: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if x.is_floating_point() or x.is_complex():
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def _validate_tree(
    tokens: torch.Tensor,
    parents: Sequence[int] | torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> tuple[list[int], list[list[int]]]:
    """Check shapes and tree structure; return tokens as a list and the children lists."""
    tok = _as_int_list(tokens, "tokens")
    children = tree_children(parents)
    n = len(tok)
    if len(children) != n:
        raise ValueError(f"tokens has {n} nodes but parents has {len(children)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must be [N={n}, V], got {tuple(target_probs.shape)}")
    if not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be floating point, got {target_probs.dtype}")
    vocab = target_probs.shape[1]
    if draft_probs is not None:
        if tuple(draft_probs.shape) != tuple(target_probs.shape):
            raise ValueError(
                f"draft_probs must have the shape of target_probs {tuple(target_probs.shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )
        if not draft_probs.is_floating_point():
            raise ValueError(f"draft_probs must be floating point, got {draft_probs.dtype}")
    bad = [i for i, t in enumerate(tok) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"tokens out of vocab range [0, {vocab}) at nodes {bad[:5]}")
    return tok, children
