"""EAGLE draft (Li et al., 2024): one decoder layer of the target's own family, working on features.

Draft position t reads the pair (f_t, x_{t+1}) — the target's feature at t and the token that
actually followed — as ``fc(concat(embed(x_{t+1}), f_t))``, runs one decoder layer (causal attention
over earlier pairs, rotary positions t) and outputs a prediction of f_{t+1}. The target's frozen
lm_head turns that prediction into logits for x_{t+2}. Knowing x_{t+1} removes most of the
uncertainty of the next feature, which is why a single layer drafts well.

The embedding and lm_head (and, for a feature layer below the top, the final norm) are the target's,
held unregistered: never trained, never saved. The checkpoint holds ``fc`` + the layer and records
the target identity, so loading it for another target is refused.
"""

from __future__ import annotations

import copy
import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftheads.heads.checkpoint import read_head, save_head
from draftheads.heads.target import FrozenTarget, TargetIdentity, check_identity

FAMILY = "eagle"

# Target-config fields that shape the draft layer; saved so a checkpoint is self-describing and
# checked on load (a same-fingerprint target cannot differ, but a mismatch-allowed load could).
LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "attention_bias",
                "mlp_bias", "max_position_embeddings")


@dataclass
class EagleConfig:
    """Architecture of an EAGLE draft (saved in every checkpoint)."""

    hidden_size: int = 0  # the target's hidden size (filled from the target)
    vocab_size: int = 0  # the target's vocabulary (filled from the target)
    feature_layer: int = -1  # target hidden-state index read and predicted (heads/target.py convention; -1 = L)
    num_target_layers: int = 0  # L of the target (to resolve feature_layer and check on load)
    fc_bias: bool = True  # bias in the fusion projection fc: 2H -> H
    layer_config: dict[str, Any] = field(default_factory=dict)  # target-config fields the draft layer was built from

    def __post_init__(self) -> None:
        if self.num_target_layers and not -1 <= self.feature_layer <= self.num_target_layers:
            raise ValueError(f"head.feature_layer must be -1 or in 0..{self.num_target_layers}, "
                             f"got {self.feature_layer}")

    @property
    def resolved_layer(self) -> int:
        """The feature layer as a concrete index 0..L."""
        return self.num_target_layers if self.feature_layer == -1 else self.feature_layer

    @property
    def needs_final_norm(self) -> bool:
        """Layer L is already final-normed (what lm_head reads); lower layers need the target's norm first."""
        return self.resolved_layer != self.num_target_layers


def _base(target: FrozenTarget) -> nn.Module:
    m = target.model
    return m.get_decoder() if hasattr(m, "get_decoder") else m.model


def _layer_fields(config: Any) -> dict[str, Any]:
    d = json.loads(config.to_json_string(use_diff=False))
    return {k: d[k] for k in LAYER_FIELDS if k in d}


def check_layer_fields(saved: dict[str, Any], target: FrozenTarget, where: str) -> None:
    """Refuse a draft whose layers were built from other target-config fields than the loaded target's."""
    current = _layer_fields(target.config)
    for k, v in saved.items():
        if k in current and current[k] != v:
            raise ValueError(f"{where}: field layer_config.{k} is {v!r} there but {current[k]!r} for the "
                             f"loaded target {target.identity.name!r}")


def check_target_layers(saved: Any, target: FrozenTarget, where: str) -> None:
    if int(saved or 0) != target.num_layers:
        raise ValueError(f"{where}: field num_target_layers is {saved} there but the loaded target has "
                         f"{target.num_layers} layers")


def load_draft_weights(draft: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> nn.Module:
    """Load a checkpoint's tensors into a draft built from its config; refuse any missing or unexpected one."""
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return draft


def draft_layer_config(target: FrozenTarget) -> Any:
    """The target's config reduced to one layer: the draft layer is built exactly like the target's layers."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = 1
    # A full-attention layer: the draft attends to what its masks allow (the whole context), and a sliding-window
    # type would make a cache built from this config (DynamicCache(config=...)) drop the draft's older keys.
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"]
    elif getattr(cfg, "sliding_window", None):  # every layer slides (Mistral, Phi-3)
        cfg.sliding_window = None
    # Tree masks need sdpa or eager; flash kernels take no arbitrary mask.
    impl = getattr(cfg, "_attn_implementation", None)
    cfg._attn_implementation = "eager" if impl == "eager" else "sdpa"
    return cfg


def rotary_kwargs(rotary: nn.Module, layer_config: Any) -> dict[str, Any]:
    """Extra arguments the family's rotary embedding needs: Gemma 3 keeps one table per layer type (local and global
    bases) and asks which; the draft layer's type is its config's only one (draft_layer_config)."""
    if "layer_type" not in inspect.signature(type(rotary).forward).parameters:
        return {}
    return {"layer_type": list(layer_config.layer_types)[0]}


def family_init(layer: nn.Module, target: FrozenTarget) -> None:
    """Initialize a draft layer built from the target's layer class the way the target's family initializes it.

    Why: the layer's constructor leaves some parameters as ``torch.empty`` memory for the model's own init to fill —
    mixture-of-experts weights (Qwen3-MoE: NaN here), routers, attention sinks (gpt-oss: 1e38) — and the draft's own
    init below covers only its Linear layers. Run on a forked RNG, so the draws of the Linear init that follows (and
    every draft of a dense family) are what they were without it."""
    init = getattr(target.model, "_init_weights", None)
    if init is None:
        return
    with torch.random.fork_rng(devices=[]):
        for m in layer.modules():
            init(m)


def eagle_config_for(target: FrozenTarget, feature_layer: int = -1, fc_bias: bool = True) -> EagleConfig:
    L = target.num_layers
    if not -1 <= feature_layer <= L:
        raise ValueError(f"head.feature_layer must be -1 or in 0..{L} for this target, got {feature_layer}")
    return EagleConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                       feature_layer=L if feature_layer == -1 else feature_layer, num_target_layers=L,
                       fc_bias=fc_bias, layer_config=_layer_fields(target.config))


def attention_bias(allowed: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool (True = may attend) -> the layer's mask: bool for sdpa, additive float for eager."""
    m = allowed[:, None]  # [B, 1, Q, K]
    if impl == "sdpa":
        return m
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)


class EagleDraft(nn.Module):
    """fc(concat(embed(x_{t+1}), f_t)) -> one target-family decoder layer -> predicted f_{t+1}."""

    def __init__(self, config: EagleConfig, target: FrozenTarget):
        super().__init__()
        if config.hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE config is for hidden {config.hidden_size} / vocab {config.vocab_size}, the "
                             f"target has {target.hidden_size} / {target.vocab_size}")
        if config.num_target_layers != target.num_layers:
            raise ValueError(f"EAGLE config num_target_layers is {config.num_target_layers}, the target has "
                             f"{target.num_layers} layers")
        self.config = config
        H = config.hidden_size
        self.layer_config = draft_layer_config(target)
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        layer_cls = type(target.decoder_layers()[0])  # the target family's own layer: no hard-coded Llama
        self.layer = layer_cls(self.layer_config, layer_idx=0)
        base = _base(target)
        self.rotary = type(base.rotary_emb)(config=self.layer_config)  # buffers only, not persistent
        self._rope_kw = rotary_kwargs(self.rotary, self.layer_config)
        family_init(self.layer, target)
        self._init_weights(float(getattr(self.layer_config, "initializer_range", 0.02)))
        # Frozen target modules, unregistered: not trained, not in state_dict, not wrapped by DDP.
        object.__setattr__(self, "_embed", target.embed_tokens())
        object.__setattr__(self, "_lm_head", target.lm_head())
        object.__setattr__(self, "_final_norm", base.norm if config.needs_final_norm else None)

    def _init_weights(self, std: float) -> None:
        for m in [self.fc, *self.layer.modules()]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @property
    def attn_impl(self) -> str:
        return self.layer_config._attn_implementation

    def cast(self, dtype: torch.dtype) -> "EagleDraft":
        """Cast the trainable weights for inference; rotary frequencies stay fp32."""
        self.fc.to(dtype)
        self.layer.to(dtype)
        return self

    def forward(
        self,
        features: torch.Tensor,  # [B, S, H] f_t (target features, or the draft's own predictions when drafting)
        next_ids: torch.Tensor,  # [B, S] x_{t+1}
        position_ids: torch.Tensor,  # [B, S] t
        allowed: torch.Tensor,  # [B, S, K] bool: query s may attend key k (K = cached + S)
        cache: Any = None,  # the draft's own 1-layer cache (drafting) or None (training)
    ) -> torch.Tensor:
        """Predicted features f_{t+1}: [B, S, H]."""
        w = self.fc.weight
        e = self._embed(next_ids).to(w.dtype)  # [B, S, H]
        x = self.fc(torch.cat([e, features.to(w.dtype)], dim=-1))  # [B, S, H]
        pos_emb = self.rotary(x, position_ids, **self._rope_kw)
        mask = attention_bias(allowed, self.attn_impl, x.dtype)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, cache=cache,
                         use_cache=cache is not None, position_embeddings=pos_emb)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] predicted features -> [.., V] through the target's frozen (norm +) lm_head."""
        return self._lm_head(self.lm_head_input(h))

    def lm_head_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the frozen lm_head reads for predicted features h [.., H]: the target's final norm applied when the
        feature layer is below the top, in the lm_head's dtype (training's fused loss projects it itself)."""
        if self._final_norm is not None:
            h = self._final_norm(h.to(self._lm_head.weight.dtype))
        return h.to(self._lm_head.weight.dtype)

    def frozen_lm_head(self) -> nn.Module:
        """The target's lm_head the draft projects through (frozen; never trained or saved with the draft)."""
        return self._lm_head

    # ------------------------------------------------------------------ checkpoints
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | Path, target: TargetIdentity, extra: dict[str, Any] | None = None) -> Path:
        return save_head(path, FAMILY, asdict(self.config), target.to_dict(), self.trainable_state_dict(), extra)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: FrozenTarget, allow_target_mismatch: bool = False,
                        ) -> "EagleDraft":
        cfg, tensors = read_head(path, FAMILY)
        where = f"EAGLE checkpoint {Path(path) / 'config.json'}"
        check_identity(cfg["target"], target.identity, where, strict_fingerprint=not allow_target_mismatch)
        config = EagleConfig(**cfg["head_config"])
        check_layer_fields(config.layer_config, target, where)
        check_target_layers(config.num_target_layers, target, where)
        return load_draft_weights(cls(config, target), tensors, where)
