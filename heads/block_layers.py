"""The block draft's ``context=kv`` layers (DFlash): the fused context enters every layer as keys and values.

Why a layer of our own: in ``context=prefix`` the context entries run through the draft's layers as a causal
prefix (queries, MLP and all). DFlash instead projects the one fused context vector per position straight into
each layer's keys and values: context positions never get queries or an MLP, so training and the per-step
commit cost a few projections per position, and the layout is the one ``speculators`` 0.9 (``dflash``) and the
engines that load it run. The layer is Qwen3-shaped whatever the target family (per-head RMSNorm on queries and
keys, RMSNorm, gated MLP), as speculators builds it; rotary tables come from the target family's own class.

Per layer: q, k, v = proj(norm(x)); context keys/values = k_proj(c), v_proj(c) of the normed fused context c
(no input norm, as in DFlash); q_norm/k_norm per head, then rotary at each entry's position; a block entry
attends to the context keys its mask allows and to its own block.
"""

from __future__ import annotations

from typing import Any, Sequence

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, nkv, T, d] (keys normed and rotated)


def kv_layer_config(lc: Any) -> Any:
    """The target's layer config in the fields a Qwen3-shaped layer and rotary read: ``hidden_act`` (Gemma names it
    ``hidden_activation``), ``head_dim``, and one set of rope parameters (Gemma 3 keeps one per layer type: the draft's
    layers attend in full, so the full-attention one)."""
    lc = copy.deepcopy(lc)
    if getattr(lc, "hidden_act", None) is None:
        lc.hidden_act = getattr(lc, "hidden_activation", None) or "silu"
    if getattr(lc, "head_dim", None) is None:
        lc.head_dim = lc.hidden_size // lc.num_attention_heads
    rope = getattr(lc, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        lc.rope_parameters = dict(rope["full_attention"])
    return lc


def kv_rotary(lc: Any) -> nn.Module:
    """Rotary tables as speculators' DFlash builds them (Qwen3's class), whatever the target family."""
    return Qwen3RotaryEmbedding(config=lc)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[B, h, S, d] rotated by per-position tables [B, S, d]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class InjectedAttention(nn.Module):
    """Self-attention over [context keys/values | the entries' own keys/values] (GQA, per-head q/k norms)."""

    def __init__(self, lc: Any):
        super().__init__()
        H, nh, nkv = lc.hidden_size, lc.num_attention_heads, lc.num_key_value_heads
        d = getattr(lc, "head_dim", None) or H // nh
        self.nh, self.nkv, self.d = nh, nkv, d
        bias = bool(getattr(lc, "attention_bias", False))
        self.q_proj = nn.Linear(H, nh * d, bias=bias)
        self.k_proj = nn.Linear(H, nkv * d, bias=bias)
        self.v_proj = nn.Linear(H, nkv * d, bias=bias)
        self.o_proj = nn.Linear(nh * d, H, bias=bias)
        eps = float(getattr(lc, "rms_norm_eps", 1e-6))
        self.q_norm = Qwen3RMSNorm(d, eps=eps)
        self.k_norm = Qwen3RMSNorm(d, eps=eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, S, _ = x.shape
        return x.view(B, S, n, self.d).transpose(1, 2)  # [B, n, S, d]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """[B, S, H] entries -> their keys (normed, rotated) and values [B, nkv, S, d]."""
        k = _rope(self.k_norm(self._heads(self.k_proj(x), self.nkv)), cos, sin)
        return k, self._heads(self.v_proj(x), self.nkv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: KV, allowed: torch.Tensor,
                ) -> torch.Tensor:
        """x [B, S, H] (normed); ctx keys/values [B, nkv, T, d]; allowed [B, S, T + S] -> [B, S, H]."""
        B, S, _ = x.shape
        q = _rope(self.q_norm(self._heads(self.q_proj(x), self.nh)), cos, sin)  # [B, nh, S, d]
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([ctx[0], k], dim=2), torch.cat([ctx[1], v], dim=2)  # [B, nkv, T + S, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.nh * self.d))


class InjectedLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x), context), then x + mlp(norm(x))."""

    def __init__(self, lc: Any):
        super().__init__()
        eps = float(getattr(lc, "rms_norm_eps", 1e-6))
        self.input_layernorm = Qwen3RMSNorm(lc.hidden_size, eps=eps)
        self.self_attn = InjectedAttention(lc)
        self.post_attention_layernorm = Qwen3RMSNorm(lc.hidden_size, eps=eps)
        self.mlp = Qwen3MLP(lc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: KV, allowed: torch.Tensor,
                ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


def context_kv(layers: Sequence[InjectedLayer], ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ) -> list[KV]:
    """Normed fused context [B, T, H] at rotary tables [B, T, d] -> each layer's context keys/values."""
    return [layer.self_attn.keys_values(ctx, cos, sin) for layer in layers]
