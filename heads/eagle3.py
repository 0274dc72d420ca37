"""EAGLE-3 draft (Li et al., 2025): fused low/mid/high target features, one decoder layer, a draft vocabulary.

Step 0 at draft position t reads the target's hidden states at three layers (default: the inputs of
decoder layers 2, L//2 and L-3; heads/target.py convention) fused by ``fc: n_aux·H -> H`` (with
``aux_scale``, of the features times a fixed per-channel scale: heads/feature_scale.py), together
with the token that actually followed, x_{t+1}. The layer's attention reads
``[input_layernorm(embed(x_{t+1})); hidden_norm(h)]`` (2H wide: q/k/v project from 2H, o_proj back
to H) while the residual stream carries h (or hidden_norm(h) with ``norm_before_residual``); then the
usual post-attention norm + MLP residual. The final ``norm`` + the draft's own ``lm_head`` [DV, H]
give logits over the *draft vocabulary*; ``d2t`` maps draft id i to target id ``i + d2t[i]``.

Unlike EAGLE, the draft does not regress the target's feature: its *output hidden state* (the
pre-final-norm residual stream, what the reference implementations feed back) becomes the next
step's h — in training ("training-time test", :meth:`Eagle3Draft.rollout`) and in drafting alike.
So step s at position t reads (output of step s-1 at t, x_{t+1+s}) at position id t+s and predicts
x_{t+2+s}.

Parameter names follow the vLLM ``speculators`` layout (``fc``, ``layers.0.*``, ``norm``,
``lm_head``, buffers ``d2t``/``t2d``), so exports are renames at most (``aux_scale`` is folded into ``fc``). The
target's embedding is held unregistered (never trained or saved here; an export writes it from the target).

The draft vocabulary mapping is part of the checkpoint and is validated on load; it is never
rebuilt from data when a checkpoint is resumed or fine-tuned (the lm_head rows belong to it).

The draft vocabulary's size and mapping: heads/eagle3_vocab.py; training-time-test attention:
heads/eagle3_ttt.py.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from draftheads.heads.checkpoint import read_head, save_head
from draftheads.heads.eagle import (_base, _layer_fields, attention_bias, check_layer_fields, check_target_layers,
                                    draft_layer_config, family_init, load_draft_weights, rotary_kwargs)
from draftheads.heads.eagle3_ttt import ttt_attention, ttt_attention_dense
from draftheads.heads.eagle3_vocab import (DraftVocabIds, check_vocab_mapping, resolve_draft_vocab_size,
                                           vocab_mapping)
from draftheads.heads.feature_scale import FeatureScale
from draftheads.heads.target import FrozenTarget, TargetIdentity, check_identity

FAMILY = "eagle3"


# ------------------------------------------------------------------------------------------
# Configuration and validation
# ------------------------------------------------------------------------------------------

def default_aux_layers(num_layers: int) -> list[int]:
    """[2, L//2, L-3]: inputs of a low, a middle and a high decoder layer (vLLM/speculators' default too)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(aux: Sequence[int], num_layers: int, where: str = "head.aux_layers") -> list[int]:
    """Aux layers must be distinct hidden-state indices 0..L-1 (the input of decoder layer i)."""
    aux = [int(a) for a in aux]
    if not aux:
        raise ValueError(f"{where} is empty: the draft fuses at least one target layer")
    bad = [a for a in aux if not 0 <= a < num_layers]
    if bad:
        raise ValueError(f"{where} {aux}: layer ids {bad} are outside the target's depth; valid ids are "
                         f"0..{num_layers - 1} (id i = the input of decoder layer i; the target has {num_layers} "
                         f"layers)")
    if len(set(aux)) != len(aux):
        raise ValueError(f"{where} {aux} repeats a layer; set distinct ids explicitly (the default "
                         f"[2, L//2, L-3] collides for targets with fewer than 7 layers)")
    return aux


@dataclass
class Eagle3Config:
    """Architecture of an EAGLE-3 draft (saved in every checkpoint)."""

    hidden_size: int = 0  # the target's hidden size (filled from the target)
    vocab_size: int = 0  # the target's vocabulary V (filled from the target)
    num_target_layers: int = 0  # L of the target (aux layer ids are checked against it)
    aux_layers: list[int] = field(default_factory=list)  # fused hidden-state indices (input of decoder layer i)
    draft_vocab_size: int = 0  # DV <= V: rows of the draft's lm_head
    norm_before_residual: bool = False  # residual stream carries hidden_norm(h) instead of h
    aux_scale: bool = False  # fc reads the aux features times a fixed per-channel scale (buffer aux_scale)
    layer_config: dict[str, Any] = field(default_factory=dict)  # target-config fields the draft layer was built from

    def __post_init__(self) -> None:
        if self.num_target_layers:
            self.aux_layers = check_aux_layers(self.aux_layers, self.num_target_layers)
        if self.vocab_size and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size} (the target's "
                             f"vocabulary); a draft vocabulary cannot be larger than the target's")


def eagle3_config_for(target: FrozenTarget, aux_layers: Sequence[int] | None, draft_vocab_size: int,
                      norm_before_residual: bool = False, aux_scale: bool = False) -> Eagle3Config:
    L = target.num_layers
    aux = check_aux_layers(default_aux_layers(L) if aux_layers is None else aux_layers, L)
    return Eagle3Config(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=L,
                        aux_layers=aux, draft_vocab_size=resolve_draft_vocab_size(draft_vocab_size, target.vocab_size),
                        norm_before_residual=bool(norm_before_residual), aux_scale=bool(aux_scale),
                        layer_config=_layer_fields(target.config))


# ------------------------------------------------------------------------------------------
# The module
# ------------------------------------------------------------------------------------------

def _rope_fn(attn: nn.Module):
    """The target family's apply_rotary_pos_emb (same module as its attention class)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"EAGLE-3 needs apply_rotary_pos_emb in {type(attn).__module__}; this target family is "
                         f"not supported")
    return fn


class Eagle3Draft(DraftVocabIds, FeatureScale, nn.Module):
    """fc(aux) or fed-back h, with embed(x) -> one 2H-input decoder layer -> norm -> lm_head over DV."""

    def __init__(self, config: Eagle3Config, target: FrozenTarget, vocab_ids: Sequence[int] | None = None):
        super().__init__()
        if config.hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 config is for hidden {config.hidden_size} / vocab {config.vocab_size}, the "
                             f"target has {target.hidden_size} / {target.vocab_size}")
        if config.num_target_layers != target.num_layers:
            raise ValueError(f"EAGLE-3 config num_target_layers is {config.num_target_layers}, the target has "
                             f"{target.num_layers} layers")
        self.config = config
        H, DV, V = config.hidden_size, config.draft_vocab_size, config.vocab_size
        self.layer_config = draft_layer_config(target)
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)  # serving engines expect no bias
        layer = type(target.decoder_layers()[0])(self.layer_config, layer_idx=0)  # the target family's own layer
        attn = layer.self_attn
        lacks = [n for n in ("q_proj", "k_proj", "v_proj") if not isinstance(getattr(attn, n, None), nn.Linear)]
        lacks += [n for n in ("input_layernorm", "post_attention_layernorm") if not hasattr(layer, n)]
        if lacks:  # fused projections (Phi-3's qkv_proj) or norms after the blocks (OLMo 2)
            raise ValueError(f"EAGLE-3 widens the q/k/v projections of the target's decoder layer to read [embedding; "
                             f"feature] and norms its inputs with the layer's input_layernorm; target model_type "
                             f"{target.config.model_type!r} has a {type(layer).__name__} without {lacks} (Medusa and "
                             f"EAGLE support it)")
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embed; h]: 2H wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * H, old.out_features, bias=old.bias is not None))
        norm_cls = type(layer.input_layernorm)
        eps = float(getattr(self.layer_config, "rms_norm_eps", 1e-6))
        layer.hidden_norm = norm_cls(H, eps=eps)
        self.layers = nn.ModuleList([layer])
        self.norm = norm_cls(H, eps=eps)
        self.lm_head = nn.Linear(H, DV, bias=False)
        base = _base(target)
        self.rotary = type(base.rotary_emb)(config=self.layer_config)  # buffers only, not persistent
        self._rope_kw = rotary_kwargs(self.rotary, self.layer_config)
        self.register_buffer("d2t", torch.zeros(DV, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        self._init_feature_scale()  # heads/feature_scale.py: with config.aux_scale, buffer aux_scale
        family_init(layer, target)
        self._init_weights(float(getattr(self.layer_config, "initializer_range", 0.02)))
        self._rope = _rope_fn(attn)
        params = inspect.signature(attn.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # The frozen target embedding, unregistered: not trained, not in state_dict, not wrapped by DDP.
        object.__setattr__(self, "_embed", target.embed_tokens())
        if vocab_ids is not None:
            self.set_vocab(vocab_ids, init_lm_head_from=target.lm_head().weight)

    def _init_weights(self, std: float) -> None:
        for m in [self.fc, self.lm_head, *self.layers.modules()]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ vocabulary
    @torch.no_grad()
    def set_vocab(self, vocab_ids: Sequence[int] | torch.Tensor, init_lm_head_from: torch.Tensor | None = None) -> None:
        """Install a new draft vocabulary (fresh drafts only); optionally start lm_head as the target's rows."""
        d2t, t2d = vocab_mapping(vocab_ids, self.config.vocab_size)
        if d2t.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {d2t.numel()} ids, config.draft_vocab_size is "
                             f"{self.config.draft_vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if init_lm_head_from is not None:
            self.lm_head.weight.copy_(init_lm_head_from.detach()[self.target_ids().to(init_lm_head_from.device)])

    # ------------------------------------------------------------------ forward pieces
    @property
    def attn_impl(self) -> str:
        return self.layer_config._attn_implementation

    def cast(self, dtype: torch.dtype) -> "Eagle3Draft":
        """Cast the trainable weights for inference; rotary frequencies and the vocab mapping keep their dtypes."""
        for m in (self.fc, self.layers, self.norm, self.lm_head):
            m.to(dtype)
        return self

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[.., n_aux·H] concatenated target features -> [.., H] step-0 input."""
        return self.fc_in(aux)

    def _inputs(self, h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [B, S, 2H], residual [B, S, H])."""
        layer = self.layers[0]
        w = self.fc.weight
        h = h.to(w.dtype)
        hn = layer.hidden_norm(h)
        e = layer.input_layernorm(self._embed(ids).to(w.dtype))
        return torch.cat([e, hn], dim=-1), (hn if self.config.norm_before_residual else h)

    def _finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        layer = self.layers[0]
        h = residual + attn_out
        m = layer.mlp(layer.post_attention_layernorm(h))
        return h + (m[0] if isinstance(m, tuple) else m)  # gpt-oss's MLP also returns its router scores

    def forward(
        self,
        h: torch.Tensor,  # [B, S, H] fused target features (fuse(aux)) or the draft's own earlier outputs
        next_ids: torch.Tensor,  # [B, S] the token paired with each h (x_{t+1} at step 0)
        position_ids: torch.Tensor,  # [B, S]
        allowed: torch.Tensor,  # [B, S, K] bool: query s may attend key k (K = cached + S)
        cache: Any = None,  # the draft's own 1-layer cache (drafting) or None
    ) -> torch.Tensor:
        """One pass with an arbitrary mask through the family's attention (drafting, trees): [B, S, H] outputs
        (pre-final-norm; what is fed back as the next step's h)."""
        x, residual = self._inputs(h, next_ids)
        pos_emb = self.rotary(x, position_ids, **self._rope_kw)
        mask = attention_bias(allowed, self.attn_impl, x.dtype)
        a, _ = self.layers[0].self_attn(hidden_states=x, position_embeddings=pos_emb, attention_mask=mask,
                                        **{self._cache_kw: cache})
        return self._finish(residual, a)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] draft outputs -> [.., DV] draft-vocabulary logits."""
        return self.lm_head(self.norm(h.to(self.lm_head.weight.dtype)))

    def _qkv(self, x: torch.Tensor, pos_emb: tuple[torch.Tensor, torch.Tensor],
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, nh, S, d], k/v [B, nkv, S, d] exactly as the family's attention computes them."""
        attn = self.layers[0].self_attn
        B, S, _ = x.shape
        shape = (B, S, -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = pos_emb
        q, k = self._rope(q, k, cos, sin)
        return q, k, v

    def _step_in(self, h: torch.Tensor, ids: torch.Tensor, position_ids: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A rollout step up to its attention: q, k, v and the residual stream."""
        x, residual = self._inputs(h, ids)
        q, k, v = self._qkv(x, self.rotary(x, position_ids, **self._rope_kw))
        return q, k, v, residual

    def _step_out(self, residual: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """A rollout step after its attention (a [B, nh, S, d]): o_proj, residual, norm + MLP -> the step's output."""
        B, _, S, _ = a.shape
        return self._finish(residual, self.layers[0].self_attn.o_proj(a.transpose(1, 2).reshape(B, S, -1)))

    def rollout(
        self,
        aux: torch.Tensor,  # [B, S, n_aux·H] target features at draft positions t
        tokens: torch.Tensor,  # [B, S + steps - 1]: step s reads tokens[:, s : s + S] (x_{t+1+s})
        position_ids: torch.Tensor,  # [B, S] position id of draft position t at step 0 (t, or per document)
        step0: torch.Tensor,  # [B, S, S] bool causal (per-document) mask of step 0
        steps: int,
        dense: bool = False,  # tests/benchmark: the dense (k·S)² reference mask instead of the block form
        checkpoint: bool = True,  # under grad: recompute each step's layer pieces in backward (memory; same numbers)
    ) -> list[torch.Tensor]:
        """Training-time test: ``steps`` unrolled passes; step s's h is step s-1's output at the same position,
        its tokens advance by s and its position ids by s. Returns the outputs [B, S, H] of every step.

        Under grad (and ``checkpoint``) each step's pieces before and after its attention (norms, q/k/v with their
        norms and rotary, o_proj, MLP) run under ``torch.utils.checkpoint`` and are recomputed in backward: a step
        keeps its inputs, q, k, v and attention output (O(S·(H + nh·d))) instead of every intermediate, the MLP's
        four [S, intermediate] among them (~330 MB per step at 4,096 tokens on Gemma 3 270M, 7 steps). The
        recomputation repeats the same operations, so outputs and gradients are the same."""
        B, S, _ = aux.shape
        assert tokens.shape[1] == S + steps - 1, (tokens.shape, S, steps)
        attn = self.layers[0].self_attn
        attend = ttt_attention_dense if dense else ttt_attention
        ckpt = checkpoint and torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

        def run(fn, *args):
            return torch_checkpoint(fn, *args, use_reentrant=False) if ckpt else fn(*args)

        h = self.fuse(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for s in range(steps):
            q, k, v, residual = run(self._step_in, h, tokens[:, s: s + S], position_ids + s)
            keys.append(k)
            values.append(v)
            a = attend(q, keys, values, step0, attn.scaling, softcap=getattr(attn, "attn_logit_softcapping", None),
                       sinks=getattr(attn, "sinks", None))  # [B, nh, S, d]
            h = run(self._step_out, residual, a)
            outs.append(h)
        return outs

    # ------------------------------------------------------------------ checkpoints
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights + the vocabulary mapping (buffers d2t/t2d): everything a checkpoint must hold."""
        return dict(self.state_dict())

    def save_pretrained(self, path: str | Path, target: TargetIdentity, extra: dict[str, Any] | None = None) -> Path:
        check_vocab_mapping(self.d2t.cpu(), self.t2d.cpu(), self.config.draft_vocab_size, self.config.vocab_size,
                            "the draft being saved")
        return save_head(path, FAMILY, asdict(self.config), target.to_dict(), self.trainable_state_dict(), extra)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: FrozenTarget, allow_target_mismatch: bool = False,
                        ) -> "Eagle3Draft":
        cfg, tensors = read_head(path, FAMILY)
        where = f"EAGLE-3 checkpoint {Path(path)}"
        check_identity(cfg["target"], target.identity, where, strict_fingerprint=not allow_target_mismatch)
        hc = dict(cfg["head_config"])
        check_target_layers(hc.get("num_target_layers"), target, where)
        config = Eagle3Config(**hc)
        check_layer_fields(config.layer_config, target, where)
        check_vocab_mapping(tensors.get("d2t"), tensors.get("t2d"), config.draft_vocab_size, config.vocab_size, where)
        return load_draft_weights(cls(config, target), tensors, where)
