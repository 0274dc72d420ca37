"""Simulated τ from held-out batches: where the greedy reference continuation ranks among the draft's
candidates, and the accepted lengths a chain or static tree would get. Cheap (no decoding loop), logged
with every evaluation; the measured τ of the real loop is ``train.tau_eval``."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch


log = logging.getLogger(__name__)

def greedy_windows(batch: dict[str, torch.Tensor], top_hidden: torch.Tensor, lm_head: Callable, width: int,
                   ) -> tuple[torch.Tensor, int]:
    """The positions an objective's ``acceptance_ranks`` scores, and how many were considered.

    ``top_hidden`` [B, T, H] is what the target's ``lm_head`` reads, teacher-forced on the held-out row, so its
    argmax at t is the target's greedy choice of token t+1 given the reference prefix. Position t is scored
    (win[b, t], win [B, max(T - width, 0)]) when tokens t+1 .. t+width are all assistant tokens of t's document
    that equal those greedy choices: decoding greedily from the prefix x_<=t would produce them, with x_{t+1}
    as the step's root and t+2 .. t+width checked against draft depths 1 .. width-1. Considered: positions whose
    next token is an assistant token (the coverage denominator)."""
    from draftheads.data_prep.dataset import shifted_valid
    from draftheads.train.losses import chunked_topk, vocab_of

    ids = batch["input_ids"]
    B, T = ids.shape
    # [B, T]: token t+1, one row chunk of [rows, V] logits at a time
    greedy = chunked_topk(top_hidden.reshape(B * T, -1), lm_head, 1, vocab_of(lm_head)).view(B, T)
    nxt = shifted_valid(batch, 1)  # [B, T-1]: token t+1 is an assistant token
    follows = nxt & (ids[:, 1:] == greedy[:, :-1])  # [B, T-1]: ... and the target's greedy choice
    n_pos = max(T - width, 0)
    win = follows.unfold(1, width, 1).all(-1)[:, :n_pos] if n_pos > 0 else follows.new_zeros(B, 0)
    return win, int(nxt.sum())


def reference_ranks(candidates: torch.Tensor, ref: torch.Tensor, top_k: int) -> torch.Tensor:
    """[n] rank of ref[i] among candidates[i] ([n, k] ids, best first); ``top_k`` where it is not among them."""
    hit = candidates == ref[:, None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(ref, top_k))


def accepted_lengths(ranks: torch.Tensor, paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Accepted draft tokens per position from candidate ranks [n, D] (>= top_k: not a candidate).

    Chain (paths=None): the leading run of rank-0 hits. Static tree: the reference's rank path
    (r_1, r_2, ...) is followed while it is a node of the tree — exactly what greedy verification of
    that tree accepts, since at each depth at most one candidate equals the reference token."""
    if ranks.numel() == 0:
        return torch.zeros(ranks.shape[0], dtype=torch.long)
    if paths is None:
        return (ranks == 0).long().cumprod(dim=1).sum(dim=1)
    nodes = {tuple(int(x) for x in p) for p in paths}
    out = torch.zeros(ranks.shape[0], dtype=torch.long)
    for i, row in enumerate(ranks.tolist()):
        d = 0
        while d < len(row) and tuple(row[: d + 1]) in nodes:
            d += 1
        out[i] = d
    return out
