"""Top-k of a large output projection for drafting, reading half the bytes: int8 screening + exact rescoring.

Why: a drafter only needs each frontier node's k best tokens (and their log-probabilities to rank tree
nodes), but getting them means one pass over a [V, H] lm_head per tree depth. On a CPU that pass is
bandwidth-bound: a bf16 [32k, 576] head is 37 MB, several per step, about as many bytes as the target's
own forward. Here a per-row int8 copy (half the bytes, one integer GEMM with a dynamically quantized
input) ranks the whole vocabulary; the ``shortlist`` best rows per query are then rescored from the original
weights in fp32 (cheap for a few rows; no bf16 rounding of the logits, so bf16 near-ties are ordered
better than by the plain bf16 pass), and the k best of those are returned with log-probabilities normalized by a
log-sum-exp over the exact shortlist logits and the screened rest. The candidates' order is the exact one; a true top-k token is missed only if int8
rounding pushes it below ``shortlist`` others (tested). Drafts only steer *which* tokens get verified:
the target's verification stays exact whatever the drafter proposes.

Used for bf16/fp16 drafts on a CPU (an fp32 draft keeps the exact path, which the equivalence tests use).
"""

from __future__ import annotations

import torch


def screening_available(weight: torch.Tensor) -> bool:
    """int8 screening pays where the exact pass is a low-precision CPU GEMM and torch has the int8 kernel."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch, "_int_mm"))


class ScreenedTopK:
    """top-k rows of ``x @ weight.T`` (weight [V, H]) via an int8 screen of the vocabulary."""

    def __init__(self, weight: torch.Tensor, shortlist: int = 32):
        w = weight.detach().float()  # [V, H]
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [V] per-row symmetric scale
        self.wq = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [V, H]
        self.wq_t = self.wq.t().contiguous()  # [H, V]: the faster layout for several rows (one query: wq.t())
        self.scale = scale  # [V] float32
        self.weight = weight.detach()  # [V, H] exact rows for the rescoring
        self.shortlist = int(shortlist)

    def screen(self, x: torch.Tensor) -> torch.Tensor:
        """Approximate logits [F, V] float32 for inputs x [F, H]."""
        xf = x.float()
        xs = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # [F, 1]
        xq = (xf / xs).round().clamp(-127, 127).to(torch.int8)  # [F, H]
        acc = torch._int_mm(xq, self.wq.t() if xq.shape[0] == 1 else self.wq_t)  # [F, V] int32
        return torch.mul(acc, self.scale).mul_(xs)  # [F, V] float32

    def topk(self, x: torch.Tensor, k: int, logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [F, k], values [F, k] float32) best first: log-probabilities (or raw logits if not ``logprobs``)."""
        approx = self.screen(x)  # [F, V]
        m = min(max(self.shortlist, k), approx.shape[-1])
        cand = approx.topk(m, dim=-1).indices  # [F, m]
        rows = self.weight[cand]  # [F, m, H]
        exact = torch.bmm(rows.float(), x.float()[:, :, None])[..., 0]  # [F, m] fp32: no bf16 rounding of logits
        top = exact.topk(min(k, m), dim=-1)
        vals = top.values
        if logprobs:  # normalizer: exact logits where the mass is (the shortlist), screened ones elsewhere
            vals = vals - torch.logsumexp(approx.scatter_(-1, cand, exact), dim=-1, keepdim=True)
        return cand.gather(-1, top.indices), vals
