"""Vocabulary-sized losses and metrics in row chunks: training memory that does not grow with the vocabulary.

Why: a loss over fp32 logits [n tokens, V] for every Medusa head or EAGLE-3 TTT step at once keeps K·n·V floats
(and their log-softmax) alive until backward: the quickstart's Medusa training peaked at 12.2 GB RSS on a 49k
vocabulary, and a 262k vocabulary multiplies that by 5. Here every [rows, V] tensor lives for one chunk of rows:
the forward computes a chunk's logits, loss and metrics and drops them; in training (``checkpoint``) backward
recomputes one chunk's logits at a time from the chunk's [rows, H] inputs (``torch.utils.checkpoint``), so what
stays saved between forward and backward is O(n·H), not O(n·V).

Chunks are sized in logits elements (``CHUNK_ELEMENTS``), not tokens: a 262k-vocabulary chunk has fewer rows but
the same bytes as a 49k one, so the peak is the same for both. 2^24 elements (64 MiB of fp32 per [rows, V]
buffer) is 341 rows at V = 49,152 and 64 at V = 262,144: enough rows per lm_head matmul to stay compute-bound.

- ``chunked_sum``: Σ over row chunks of a family's chunk loss (and its metric counts), checkpointed per chunk.
- ``cross_entropy_hits``: hard-label CE + top-1/top-k hit counts of one chunk (Medusa).
- ``LinearCrossEntropy``: the same through a frozen projection with its gradient taken in the forward: no
  recomputation (Medusa with the target's shared lm_head, the quickstart's setting).
- ``SoftCrossEntropy``: fused soft-label CE against a target distribution + the argmax (EAGLE, EAGLE-3).
- ``chunked_topk``: the top-k ids of projected rows without [n, V] logits (held-out metrics, simulated τ).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

CHUNK_ELEMENTS = 1 << 24  # logits elements per row chunk of a vocabulary-sized loss (64 MiB fp32)
CE_CHUNK_ELEMENTS = 1 << 22  # elements per row chunk inside the fused soft-CE (bounds its fp32 temporaries)

# fn(*row chunks, stats=bool) -> (loss sum [], metric counts [m] or None when stats=False)
ChunkFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]


def chunk_rows(vocab: int, elements: int | None = None) -> int:
    """Rows per chunk so that one [rows, vocab] buffer holds about ``elements`` (default ``CHUNK_ELEMENTS``)."""
    return max(1, (CHUNK_ELEMENTS if elements is None else int(elements)) // max(1, int(vocab)))


def chunked_sum(fn: ChunkFn, *xs: torch.Tensor, vocab: int, checkpoint: bool = True,
                elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Σ loss, Σ metric counts) of ``fn`` over row chunks of ``xs`` (all [n, ...], split along dim 0).

    With ``checkpoint`` and grad enabled each chunk runs under ``torch.utils.checkpoint``: its [rows, V] logits are
    freed after the forward and recomputed in backward, one chunk at a time. The metrics (no-grad counts) are taken
    in the forward only: the recomputation calls ``fn`` with ``stats=False``. An empty input still runs ``fn``
    once on the empty rows, so the parameters it uses get (zero) gradients on every rank (DDP, ZeRO-3/FSDP)."""
    n = xs[0].shape[0]
    rows = chunk_rows(vocab, elements)
    ckpt = checkpoint and torch.is_grad_enabled()
    total: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    for i in range(0, max(n, 1), rows):
        part = [x[i:i + rows] for x in xs]
        if ckpt:
            calls = [0]

            def run(*p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
                calls[0] += 1
                return fn(*p, stats=calls[0] == 1)  # the backward's recomputation skips the metrics

            loss, st = _checkpoint(run, *part, use_reentrant=False)
        else:
            loss, st = fn(*part, stats=True)
        total = loss if total is None else total + loss
        if st is not None:
            counts = st if counts is None else counts + st
    assert total is not None
    return total, counts


def cross_entropy_hits(z: torch.Tensor, labels: torch.Tensor, top_k: int = 5, stats: bool = True,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Σ CE(z, labels) in fp32 over a chunk (z [rows, V], labels [rows]); with ``stats`` also the counts
    [top-1 hits, top-k hits] (float, [2])."""
    z = z.float()
    ce = F.cross_entropy(z, labels, reduction="sum")
    if not stats:
        return ce, None
    with torch.no_grad():
        top = z.topk(min(top_k, z.shape[-1]), dim=-1).indices  # [rows, k]
        hits = torch.stack([(top[:, 0] == labels).sum(), (top == labels[:, None]).any(-1).sum()]).float()
    return ce, hits


class LinearCrossEntropy(torch.autograd.Function):
    """Σ CE(h·Wᵀ + b, y) over row chunks for a *frozen* projection W [V, H], with its gradient taken in the
    forward: each chunk's [rows, V] logits give the loss, the hit counts and grad_h = (softmax·Σt − t)·W at once,
    and only grad_h [n, H] is kept. The same two matmuls as the plain loss (no recomputation, unlike
    ``chunked_sum``'s checkpointing, which made a Medusa step ~1.45x slower) and O(n·H) memory; the gradient flows
    to h only. y: hard ``labels`` [n], or soft targets from ``target_probs(i, j)`` -> [j - i, V] fp32 rows (no
    grad; then ``labels`` only count hits). Counts: hard [top-1 = y, y in top-k]; soft [top-1 = target argmax,
    target argmax in top-k, top-1 = label].

    Both matmuls run in the weight's own dtype, autocast off: under bf16 autocast an fp32 frozen weight would
    be cast again for every chunk (a 335 MB bf16 copy of Gemma 3's [262k, 640] lm_head per matmul, slower than
    the fp32 product itself on CPU)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                top_k: int, need_grad: bool, target_probs: Callable[[int, int], torch.Tensor] | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        with torch.autocast(h.device.type, enabled=False):
            return LinearCrossEntropy._forward(ctx, h, weight, bias, labels, top_k, need_grad, target_probs)

    @staticmethod
    def _forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                 top_k: int, need_grad: bool, target_probs: Callable[[int, int], torch.Tensor] | None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        n, V = h.shape[0], weight.shape[0]
        rows = chunk_rows(V)
        grad = torch.empty_like(h) if need_grad else h.new_zeros(0)
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        hits = torch.zeros(2 if target_probs is None else 3, dtype=torch.float32, device=h.device)
        for i in range(0, n, rows):
            z = F.linear(h[i:i + rows].to(weight.dtype), weight, bias).float()  # [r, V]
            y = labels[i:i + rows]
            top = z.topk(min(top_k, V), dim=-1).indices  # [r, k]
            lse = torch.logsumexp(z, dim=-1)  # [r]
            if target_probs is None:
                hits += torch.stack([(top[:, 0] == y).sum(), (top == y[:, None]).any(-1).sum()]).float()
                total += (lse - z.gather(1, y[:, None])[:, 0]).sum().double()
            else:
                t = target_probs(i, i + rows)  # [r, V]
                amax = t.argmax(-1)
                hits += torch.stack([(top[:, 0] == amax).sum(), (top == amax[:, None]).any(-1).sum(),
                                     (top[:, 0] == y).sum()]).float()
                mass = t.sum(-1)
                total += (lse * mass - (t * z).sum(-1)).sum().double()
            if need_grad:
                g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                if target_probs is None:
                    g[torch.arange(y.shape[0], device=y.device), y] -= 1.0
                else:
                    g.mul_(mass[:, None]).sub_(t)
                grad[i:i + rows] = (g.to(weight.dtype) @ weight).to(h.dtype)  # [r, H]
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits)
        return total.float(), hits

    @staticmethod
    def backward(ctx, g: torch.Tensor, _unused: Any) -> tuple[Any, ...]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * g, None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, proj: Any, labels: torch.Tensor, top_k: int = 5,
                         target_probs: Callable[[int, int], torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``LinearCrossEntropy`` through the frozen linear ``proj`` when its weight is a whole, plain, frozen tensor;
    None otherwise (trainable, or sharded by ZeRO-3/FSDP: the caller's checkpointed chunks run the module)."""
    w = getattr(proj, "weight", None)
    if not (type(w) in (torch.Tensor, torch.nn.Parameter) and w.dim() == 2 and w.shape[1] == h.shape[-1]
            and w.numel() > 0 and not w.requires_grad):
        return None
    need = torch.is_grad_enabled() and h.requires_grad
    return LinearCrossEntropy.apply(h, w.detach(), None if proj.bias is None else proj.bias.detach(), labels, top_k,
                                    need, target_probs)


class SoftCrossEntropy(torch.autograd.Function):
    """Σ_rows soft-CE(p, softmax(z)) = Σ_rows (lse(z)·Σp − p·z), fused and chunked over rows.

    Why not log_softmax + product: on CPU that is ~8 full passes over an [n, V] tensor (plus fp32 copies).
    Here: forward = one max, one exp, one dot per row chunk; backward = grad · (softmax(z)·Σp − p), recomputed
    from z and the saved row lse. Also returns argmax(z) [n] (non-differentiable) from the same max pass.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        n = z.shape[0]
        ctx.chunk = c = chunk_rows(z.shape[1], CE_CHUNK_ELEMENTS)
        lse = torch.empty(n, dtype=torch.float32, device=z.device)
        amax = torch.empty(n, dtype=torch.long, device=z.device)
        total = torch.zeros((), dtype=torch.float64, device=z.device)
        for i in range(0, n, c):
            zf, pf = z[i:i + c].to(torch.float32, copy=True), p[i:i + c].float()  # zf is modified
            dot = (pf * zf).sum(-1)
            m, amax[i:i + c] = zf.max(-1)
            lse[i:i + c] = l = zf.sub_(m[:, None]).exp_().sum(-1).log_().add_(m)
            total += (l * pf.sum(-1) - dot).sum().double()
        ctx.save_for_backward(z, p, lse)
        ctx.mark_non_differentiable(amax)
        return total.float(), amax

    @staticmethod
    def backward(ctx, g: torch.Tensor, _unused: Any) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        z, p, lse = ctx.saved_tensors
        c = ctx.chunk
        grad = torch.empty_like(z)
        for i in range(0, z.shape[0], c):
            pf = p[i:i + c].float()
            q = z[i:i + c].to(torch.float32, copy=True).sub_(lse[i:i + c, None]).exp_()
            q.mul_(pf.sum(-1, keepdim=True))
            grad[i:i + c] = q.sub_(pf).mul_(g)
        return grad, None


@torch.no_grad()
def chunked_topk(h: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], k: int, vocab: int,
                 elements: int | None = None) -> torch.Tensor:
    """Top-k ids [n, k] (best first) of ``project(h)`` for h [n, H], one row chunk of logits at a time. ``project``
    runs at least once, also on no rows: under ZeRO-3/FSDP its forward is collective."""
    k = min(k, vocab)
    rows = chunk_rows(vocab, elements)

    def top(z: torch.Tensor) -> torch.Tensor:  # k = 1: argmax, whose tie-breaking (first index) greedy decoding shares
        return z.argmax(-1, keepdim=True) if k == 1 else z.topk(k, dim=-1).indices

    return torch.cat([top(project(h[i:i + rows])) for i in range(0, max(h.shape[0], 1), rows)])


def vocab_of(module: Any) -> int:
    """Output rows of a linear head (its vocabulary)."""
    return int(module.weight.shape[0])
