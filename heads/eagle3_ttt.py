"""Training-time-test attention for EAGLE-3: step s of the rollout attends to step 0's keys under the causal mask and
to the same position of steps 1..s, computed block by block instead of through a dense (k·T)² mask.

Apart from the module (heads/eagle3.py) because it is a pure tensor function with a dense reference, tested and
benchmarked (scripts/bench_ttt.py) on its own.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint


def ttt_dense_mask(step0: torch.Tensor, step: int) -> torch.Tensor:
    """Reference mask of TTT step ``step`` over the keys of steps 0..step: [B, S, (step+1)·S] bool.

    ``step0`` [B, S, S] is the step-0 (causal, per-document) mask. Steps >= 1 add one key per step
    and position: query t of step s sees step-0 keys ``step0[t]`` plus the key at the same position
    t of every step 1..s. Used only by tests and the benchmark (memory grows with step·S²).
    """
    B, S, _ = step0.shape
    eye = torch.eye(S, dtype=torch.bool, device=step0.device)[None].expand(B, S, S)
    return torch.cat([step0] + [eye] * step, dim=-1)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit softcapping (cap·tanh(x/cap) before the mask), as its eager attention applies it."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _softmax(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with gpt-oss's attention sinks, one more logit per head that takes probability
    mass and no value (dropped after the softmax). ``sinks`` is shaped to broadcast as logits[..., :1]."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.float().expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


BLOCK_SCORES = 1 << 25  # attention scores per query block (128 MiB fp32): longer sequences run block by block


def ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  step0: torch.Tensor, scaling: float, *, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of TTT step s = len(keys) - 1 without materializing the [S, (s+1)·S] mask.

    q [B, nh, S, d]; keys/values: steps 0..s, each [B, nkv, S, d] (GQA: nh = nkv·g); step0 [B, S, S]
    bool. Scores against step-0 keys form a masked [S, S] block; against steps 1..s only the same
    position counts, which is a [S, s] "diagonal" block of row-wise dot products. One softmax over
    their concatenation; memory O(S² + s·S) per head instead of O(s·S²). Returns [B, nh, S, d].
    ``softcap`` (Gemma 2) and ``sinks`` [nh] (gpt-oss) as the family's own attention applies them, so the rollout
    trains what the drafter's forward computes.

    Long sequences: when B·nh·S² scores pass ``BLOCK_SCORES`` the queries run in row blocks, each under
    ``torch.utils.checkpoint`` while training, so what a step keeps for backward is its q, k, v (O(S·d)), not its
    [S, S] probabilities (at S = 8,192 those were ~2.4 GB per step and head group; seven TTT steps passed 18 GB).
    """
    B, nh, S, d = q.shape
    rows = max(1, BLOCK_SCORES // max(1, B * nh * S))
    if rows >= S:
        return _ttt_block(q, keys, values, step0, 0, scaling, softcap, sinks)
    ckpt = torch.is_grad_enabled() and (q.requires_grad or any(k.requires_grad for k in keys))
    keys, values = tuple(keys), tuple(values)  # snapshots: the rollout appends to its lists before backward recomputes
    out = []
    for i in range(0, S, rows):
        args = (q[:, :, i:i + rows], keys, values, step0, i, scaling, softcap, sinks)
        out.append(checkpoint(_ttt_block, *args, use_reentrant=False) if ckpt else _ttt_block(*args))
    return torch.cat(out, dim=2)


def _ttt_block(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], step0: torch.Tensor,
               start: int, scaling: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``ttt_attention`` for the query rows start .. start + R (q [B, nh, R, d]): all step-0 keys, and the keys of
    steps 1..s at the same R positions. Returns [B, nh, R, d]."""
    B, nh, R, d = q.shape
    S = keys[0].shape[2]
    nkv = keys[0].shape[1]
    g = nh // nkv
    qg = q.reshape(B, nkv, g, R, d)
    sk = None if sinks is None else sinks.view(1, nkv, g, 1, 1)  # head h = kv group h // g, as repeat_kv orders them
    s0 = _capped(torch.einsum("bkgsd,bktd->bkgst", qg, keys[0]).float() * scaling, softcap)  # [B, nkv, g, R, S]
    s0 = s0.masked_fill(~step0[:, None, None, start:start + R], float("-inf"))
    if len(keys) > 1:
        diag = torch.stack([(qg * k[:, :, None, start:start + R]).sum(-1) for k in keys[1:]],
                           dim=-1).float() * scaling  # [B, nkv, g, R, s]
        p = _softmax(torch.cat([s0, _capped(diag, softcap)], dim=-1), sk).to(q.dtype)
        out = torch.einsum("bkgst,bktd->bkgsd", p[..., :S], values[0])
        for j, v in enumerate(values[1:]):
            out = out + p[..., S + j, None] * v[:, :, None, start:start + R]  # [B, nkv, g, R, d]
    else:
        p = _softmax(s0, sk).to(q.dtype)
        out = torch.einsum("bkgst,bktd->bkgsd", p, values[0])
    return out.reshape(B, nh, R, d)


def ttt_attention_dense(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                        step0: torch.Tensor, scaling: float, *, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention with the dense reference mask (tests / benchmark only)."""
    B, nh, S, d = q.shape
    g = nh // keys[0].shape[1]
    K = torch.cat(list(keys), dim=2).repeat_interleave(g, dim=1)  # [B, nh, (s+1)S, d]
    V = torch.cat(list(values), dim=2).repeat_interleave(g, dim=1)
    mask = ttt_dense_mask(step0, len(keys) - 1)[:, None]  # [B, 1, S, (s+1)S]
    scores = _capped((q @ K.transpose(-1, -2)).float() * scaling, softcap)
    sk = None if sinks is None else sinks.view(1, nh, 1, 1)
    p = _softmax(scores.masked_fill(~mask, float("-inf")), sk).to(q.dtype)
    return p @ V
