"""Block draft (DFlash-style): a few decoder layers that draft a whole block of tokens in one forward.

The draft's sequence has two kinds of entries. *Context* entries, one per position the target has run, read the
target's hidden states from several layers (low/mid/high, like EAGLE-3) through ``fc`` and a norm; they attend
causally to earlier context entries. A *block* is the step's root token (the last accepted token, not yet run by
the target) followed by ``block_size - 1`` mask entries (one learned vector); block entries attend to every
context entry before the root and bidirectionally to each other. The final norm plus the target's frozen lm_head
turn block entry j >= 1 into logits for the token j places after the root. So one draft forward proposes
``block_size - 1`` tokens, where EAGLE needs one forward per depth.

The layers are the target family's own decoder layers (full attention), as for EAGLE. The embedding and lm_head
are the target's, held unregistered: never trained, never saved. The checkpoint records the target identity, so
loading it for another target is refused.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from draftheads.heads.checkpoint import read_head, save_head
from draftheads.heads.eagle import (_base, _layer_fields, attention_bias, draft_layer_config, family_init,
                                    rotary_kwargs)
from draftheads.heads.eagle3 import check_aux_layers, default_aux_layers
from draftheads.heads.target import FrozenTarget, TargetIdentity, check_identity

FAMILY = "block"


@dataclass
class BlockConfig:
    """Architecture of a block draft (saved in every checkpoint)."""

    hidden_size: int = 0  # the target's hidden size (filled from the target)
    vocab_size: int = 0  # the target's vocabulary (filled from the target)
    num_target_layers: int = 0  # L of the target (to check on load)
    context_layers: list[int] = field(default_factory=list)  # target hidden-state indices fused into context entries
    num_layers: int = 2  # draft decoder layers
    block_size: int = 8  # root + block_size - 1 drafted tokens per forward
    layer_config: dict[str, Any] = field(default_factory=dict)  # target-config fields the draft layers were built from

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"head.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"head.block_size must be >= 2 (the root and at least one drafted token), "
                             f"got {self.block_size}")
        if self.num_target_layers:
            self.context_layers = check_aux_layers(self.context_layers, self.num_target_layers, "head.context_layers")


def block_config_for(target: FrozenTarget, context_layers: Sequence[int] | None = None, num_layers: int = 2,
                     block_size: int = 8) -> BlockConfig:
    L = target.num_layers
    # low/mid/high like EAGLE-3; shallow targets (under 7 layers) get the distinct ones of that choice
    layers = sorted({min(max(a, 0), L - 1) for a in default_aux_layers(L)}) if context_layers is None \
        else list(context_layers)
    return BlockConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=L,
                       context_layers=check_aux_layers(layers, L, "head.context_layers"), num_layers=int(num_layers),
                       block_size=int(block_size), layer_config=_layer_fields(target.config))


class BlockDraft(nn.Module):
    """Context entries fc(concat_l h_l) and block entries [embed(root), mask, ...] -> N decoder layers -> norm."""

    def __init__(self, config: BlockConfig, target: FrozenTarget):
        super().__init__()
        if (config.hidden_size, config.vocab_size, config.num_target_layers) != \
                (target.hidden_size, target.vocab_size, target.num_layers):
            raise ValueError(f"block draft config is for hidden {config.hidden_size} / vocab {config.vocab_size} / "
                             f"{config.num_target_layers} layers; the target has {target.hidden_size} / "
                             f"{target.vocab_size} / {target.num_layers}")
        self.config = config
        H = config.hidden_size
        lc = copy.deepcopy(draft_layer_config(target))  # full attention, sdpa or eager
        lc.num_hidden_layers = config.num_layers
        if getattr(lc, "layer_types", None):
            lc.layer_types = ["full_attention"] * config.num_layers
        self.layer_config = lc
        base = _base(target)
        self.fc = nn.Linear(len(config.context_layers) * H, H, bias=False)
        norm_cls, eps = type(base.norm), float(getattr(lc, "rms_norm_eps", 1e-6))
        self.context_norm = norm_cls(H, eps=eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        layer_cls = type(target.decoder_layers()[0])  # the target family's own layer
        self.layers = nn.ModuleList([layer_cls(lc, layer_idx=i) for i in range(config.num_layers)])
        self.norm = norm_cls(H, eps=eps)
        self.rotary = type(base.rotary_emb)(config=lc)
        self._rope_kw = rotary_kwargs(self.rotary, lc)
        for layer in self.layers:
            family_init(layer, target)
        std = float(getattr(lc, "initializer_range", 0.02))
        for m in [self.fc, *self.layers.modules()]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.mask_embedding, 0.0, std)
        if isinstance(base.norm, norm_cls):  # start at the target's output scale: its lm_head reads its final norm
            self.norm.load_state_dict(base.norm.state_dict())
        object.__setattr__(self, "_embed", target.embed_tokens())
        object.__setattr__(self, "_lm_head", target.lm_head())
        params = inspect.signature(layer_cls.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def attn_impl(self) -> str:
        return self.layer_config._attn_implementation

    def cast(self, dtype: torch.dtype) -> "BlockDraft":
        """Cast the trainable weights for inference; rotary frequencies stay fp32."""
        for m in (self.fc, self.context_norm, self.layers, self.norm):
            m.to(dtype)
        self.mask_embedding.data = self.mask_embedding.data.to(dtype)
        return self

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., n_layers·H] target hidden states (concatenated in ``context_layers`` order) -> [.., H] entries."""
        return self.context_norm(self.fc(hidden.to(self.fc.weight.dtype)))

    def block(self, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """[B, N] token ids and mask flags -> [B, N, H] block entries (a mask entry ignores its id)."""
        e = self._embed(ids).to(self.fc.weight.dtype)  # [B, N, H]
        return torch.where(is_mask[..., None], self.mask_embedding.to(e.dtype), e)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor, cache: Any = None,
                ) -> torch.Tensor:
        """Entries x [B, S, H] at positions [B, S]; ``allowed`` [B, S, K] (K = cached + S) -> [B, S, H] normed."""
        pos_emb = self.rotary(x, position_ids, **self._rope_kw)
        mask = attention_bias(allowed, self.attn_impl, x.dtype)
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None,
                        position_embeddings=pos_emb, **{self._cache_kw: cache})
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] draft outputs -> [.., V] through the target's frozen lm_head."""
        return self._lm_head(h.to(self._lm_head.weight.dtype))

    def frozen_lm_head(self) -> nn.Module:
        return self._lm_head

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str | Path, target: TargetIdentity, extra: dict[str, Any] | None = None) -> Path:
        return save_head(path, FAMILY, asdict(self.config), target.to_dict(), dict(self.state_dict()), extra)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: FrozenTarget, allow_target_mismatch: bool = False,
                        ) -> "BlockDraft":
        cfg, tensors = read_head(path, FAMILY)
        where = f"block-draft checkpoint {Path(path) / 'config.json'}"
        check_identity(cfg["target"], target.identity, where, strict_fingerprint=not allow_target_mismatch)
        config = BlockConfig(**cfg["head_config"])
        current = _layer_fields(target.config)
        for k, v in config.layer_config.items():
            if k in current and current[k] != v:
                raise ValueError(f"{where}: field layer_config.{k} is {v!r} there but {current[k]!r} for the "
                                 f"loaded target {target.identity.name!r}")
        draft = cls(config, target)
        missing, unexpected = draft.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"{where}: weights do not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        return draft
