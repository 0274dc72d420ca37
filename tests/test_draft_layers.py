"""Draft layers built from other target families' layer classes: EAGLE-3's training-time-test attention with Gemma 2's
logit softcapping and gpt-oss's attention sinks equals the dense reference and the family's own eager attention.
(The drafts on every architecture, end to end: tests/test_arch_matrix.py.)"""

from __future__ import annotations

import pytest
import torch

from draftheads.heads.eagle3_ttt import ttt_attention, ttt_attention_dense, ttt_dense_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(S: int = 5, steps: int = 3, nkv: int = 2, g: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(1, nkv * g, S, d, generator=gen)  # scores of a few units: softcap 2.0 bends them
    keys = [torch.randn(1, nkv, S, d, generator=gen) for _ in range(steps)]
    values = [torch.randn(1, nkv, S, d, generator=gen) for _ in range(steps)]
    step0 = torch.ones(S, S, dtype=torch.bool).tril()[None]
    sinks = torch.randn(nkv * g, generator=gen)
    return q, keys, values, step0, sinks


def _eager_reference(q, keys, values, step0, scaling, softcap, sinks):
    """transformers' eager attention as Gemma 2 (softcap before the mask) and gpt-oss (a sink logit per head, dropped
    after the softmax) compute it, over the dense TTT mask."""
    g = q.shape[1] // keys[0].shape[1]
    K = torch.cat(keys, 2).repeat_interleave(g, 1)
    V = torch.cat(values, 2).repeat_interleave(g, 1)
    w = q @ K.transpose(-1, -2) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~ttt_dense_mask(step0, len(keys) - 1)[:, None], float("-inf"))
    if sinks is not None:
        w = torch.cat([w, sinks.view(1, -1, 1, 1).expand(*w.shape[:-1], 1)], -1)
    p = torch.softmax(w, -1)
    return (p[..., :-1] if sinks is not None else p) @ V


@pytest.mark.parametrize("blocks", [False, True])
def test_ttt_attention_with_softcap_and_sinks_equals_dense_and_eager(blocks, monkeypatch):
    q, keys, values, step0, sinks = _inputs()
    if blocks:  # query row blocks of one row, as long sequences run
        import draftheads.heads.eagle3_ttt as ttt

        monkeypatch.setattr(ttt, "BLOCK_SCORES", q.shape[0] * q.shape[1] * q.shape[2])
    for softcap, sk in ((None, None), (2.0, None), (None, sinks), (2.0, sinks)):
        for s in range(1, len(keys) + 1):
            block = ttt_attention(q, keys[:s], values[:s], step0, 0.3, softcap=softcap, sinks=sk)
            dense = ttt_attention_dense(q, keys[:s], values[:s], step0, 0.3, softcap=softcap, sinks=sk)
            ref = _eager_reference(q, keys[:s], values[:s], step0, 0.3, softcap, sk)
            torch.testing.assert_close(block, dense, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(block, ref, rtol=1e-5, atol=1e-6)
    plain = ttt_attention(q, keys, values, step0, 0.3)
    assert not torch.allclose(plain, ttt_attention(q, keys, values, step0, 0.3, softcap=2.0))  # the knobs bite
    assert not torch.allclose(plain, ttt_attention(q, keys, values, step0, 0.3, sinks=sinks))
