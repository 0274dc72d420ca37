"""The two block-draft layouts (heads/block.py): how the context reaches the blocks.

``BlockDraft(config, target)`` builds the one ``config.context`` names; everything outside these classes calls
their common methods (``block``, ``rows``, ``commit``, ``run_block``) and never branches on the layout.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn

from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from draftheads.heads.block import BlockDraft
from draftheads.heads.block_layers import KV, InjectedLayer, context_kv, kv_layer_config, kv_rotary
from draftheads.heads.eagle import _base, attention_bias, family_init, rotary_kwargs
from draftheads.heads.target import FrozenTarget


class KVBlockDraft(BlockDraft):
    """``context=kv`` (DFlash; exports to speculators ``dflash``): the normed fused context is each layer's keys and
    values (no queries, no MLP at context positions); mask entries are the frozen embedding of ``mask_token_id``."""

    def _norm_class(self, base: nn.Module) -> type[nn.Module]:
        return Qwen3RMSNorm  # plain RMSNorm everywhere, as DFlash

    def _build_layers(self, lc: Any, target: FrozenTarget) -> Any:
        lc = kv_layer_config(lc)
        self.layers = nn.ModuleList([InjectedLayer(lc) for _ in range(self.config.num_layers)])
        self.rotary = kv_rotary(lc)
        return lc

    def block(self, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        # the mask token's frozen embedding, as engines loading a DFlash export compute it
        ids = torch.where(is_mask, torch.full_like(ids, int(self.config.mask_token_id)), ids)
        return self._embed(ids).to(self.fc.weight.dtype)  # [B, N, H]

    def context_kv(self, ctx: torch.Tensor, position_ids: torch.Tensor) -> list[KV]:
        """Context entries [B, T, H] (from :meth:`context`) at positions [B, T] -> each layer's keys/values."""
        cos, sin = self.rotary(ctx, position_ids)
        return context_kv(self.layers, ctx, cos.to(ctx.dtype), sin.to(ctx.dtype))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor, ctx: Sequence[KV],
                ) -> torch.Tensor:
        """Block entries x [B, S, H] at positions [B, S]; ``ctx`` each layer's context keys/values [B, nkv, T, d]
        (:meth:`context_kv`); ``allowed`` [B, S, T + S] -> [B, S, H] normed."""
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, cos, sin, kv, allowed)
        return self.norm(x)

    def rows(self, ctx: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor, blk: torch.Tensor, blk_pos: torch.Tensor,
             blk_allowed: torch.Tensor) -> torch.Tensor:
        return self(blk, blk_pos, blk_allowed, self.context_kv(ctx, pos))  # queries are the blocks' entries only

    def commit(self, x: torch.Tensor, pos: torch.Tensor, caches: Any) -> None:
        for i, (k, v) in enumerate(self.context_kv(x, pos)):
            caches.update(k, v, i)

    def run_block(self, x: torch.Tensor, pos: torch.Tensor, caches: Any) -> torch.Tensor:
        ctx = caches.filled()
        allowed = torch.ones(1, x.shape[1], ctx[0][0].shape[-2] + x.shape[1], dtype=torch.bool, device=x.device)
        return self(x, pos, allowed, ctx)


class PrefixBlockDraft(BlockDraft):
    """``context=prefix``: context entries run through the target family's own decoder layers as a causal prefix;
    mask entries are one learned vector. Checkpoints written before ``context`` existed are of this layout."""

    def _norm_class(self, base: nn.Module) -> type[nn.Module]:
        return type(base.norm)

    def _build_layers(self, lc: Any, target: FrozenTarget) -> Any:
        self.mask_embedding = nn.Parameter(torch.zeros(self.config.hidden_size))
        layer_cls = type(target.decoder_layers()[0])  # the target family's own layer
        self.layers = nn.ModuleList([layer_cls(lc, layer_idx=i) for i in range(self.config.num_layers)])
        params = inspect.signature(layer_cls.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.rotary = type(_base(target).rotary_emb)(config=lc)
        self._rope_kw = rotary_kwargs(self.rotary, lc)
        for layer in self.layers:
            family_init(layer, target)
        return lc

    def _init_extra(self, std: float) -> None:
        nn.init.normal_(self.mask_embedding, 0.0, std)

    def cast(self, dtype: torch.dtype) -> "BlockDraft":
        super().cast(dtype)
        self.mask_embedding.data = self.mask_embedding.data.to(dtype)
        return self

    def block(self, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        e = self._embed(ids).to(self.fc.weight.dtype)  # [B, N, H]
        return torch.where(is_mask[..., None], self.mask_embedding.to(e.dtype), e)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor, cache: Any = None,
                ) -> torch.Tensor:
        """Entries x [B, S, H] at positions [B, S]; ``allowed`` [B, S, K], K = cached + S, ``cache`` the layers'
        KV cache (or None) -> [B, S, H] normed."""
        pos_emb = self.rotary(x, position_ids, **self._rope_kw)
        mask = attention_bias(allowed, self.attn_impl, x.dtype)
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None,
                        position_embeddings=pos_emb, **{self._cache_kw: cache})
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)

    def rows(self, ctx: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor, blk: torch.Tensor, blk_pos: torch.Tensor,
             blk_allowed: torch.Tensor) -> torch.Tensor:
        B, T, _ = ctx.shape
        S = blk.shape[1]
        same = doc[:, :, None] == doc[:, None, :]  # [B, T, T]
        ctx_allowed = torch.ones(T, T, dtype=torch.bool, device=ctx.device).tril()[None] & same
        ctx_allowed = torch.cat([ctx_allowed, ctx_allowed.new_zeros(B, T, S)], dim=2)  # [B, T, T + S]
        h = self(torch.cat([ctx, blk], dim=1), torch.cat([pos, blk_pos], dim=1),
                 torch.cat([ctx_allowed, blk_allowed], dim=1))  # [B, T + S, H]
        return h[:, T:]

    def commit(self, x: torch.Tensor, pos: torch.Tensor, caches: Any) -> None:
        m, c = x.shape[1], caches.get_seq_length()
        allowed = torch.ones(1, m, c + m, dtype=torch.bool, device=x.device)
        allowed[0, :, c:] = torch.ones(m, m, dtype=torch.bool, device=x.device).tril()
        self(x, pos, allowed, caches)

    def run_block(self, x: torch.Tensor, pos: torch.Tensor, caches: Any) -> torch.Tensor:
        c, n = caches.get_seq_length(), x.shape[1]
        h = self(x, pos, torch.ones(1, n, c + n, dtype=torch.bool, device=x.device), caches)
        caches.crop(c)  # the block's entries are never committed
        return h


LAYOUTS: dict[str, type[BlockDraft]] = {"kv": KVBlockDraft, "prefix": PrefixBlockDraft}
