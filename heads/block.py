"""Block draft (DFlash-style): a few decoder layers that draft a whole block of tokens in one forward.

The draft's sequence has two kinds of entries. *Context* entries, one per position the target has run, read the
target's hidden states from several layers (low/mid/high, like EAGLE-3) through ``fc`` and a norm; they attend
causally to earlier context entries. A *block* is the step's root token (the last accepted token, not yet run by
the target) followed by ``block_size - 1`` mask entries (one learned vector); block entries attend to every
context entry before the root and bidirectionally to each other. The final norm plus the target's frozen lm_head
turn block entry j >= 1 into logits for the token j places after the root. So one draft forward proposes
``block_size - 1`` tokens, where EAGLE needs one forward per depth.

``context`` picks how block entries see the context. ``prefix``: context entries run through the draft's layers
(the target family's own decoder layers, full attention, as for EAGLE) as a causal prefix, and mask entries are one
learned vector. ``kv`` (DFlash, the layout ``speculators`` exports): the normed fused context becomes each layer's
keys and values directly (heads/block_layers.py), and mask entries are the frozen embedding of ``mask_token_id``.
The embedding and lm_head are the target's, held unregistered: never trained, never saved. The checkpoint records
the target identity, so loading it for another target is refused.

``draft_vocab_size`` DV > 0 gives the draft its own output vocabulary, as EAGLE-3's: ``lm_head`` holds the
target's lm_head rows of DV target ids (frozen, saved with the draft because engines cannot rebuild a reduced
head), ``d2t``/``t2d`` map between draft and target ids. The loss and the drafter's logits then cost DV/V of the
full head, which matters for a 262k vocabulary and pays for more anchors per row; a token outside the vocabulary
is never drafted.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from draftheads.heads.checkpoint import read_head, save_head
from draftheads.heads.eagle import _base, _layer_fields, check_layer_fields, draft_layer_config, load_draft_weights
from draftheads.heads.eagle3 import check_aux_layers, default_aux_layers
from draftheads.heads.eagle3_vocab import DraftVocabIds, check_vocab_mapping, vocab_mapping
from draftheads.heads.feature_scale import FeatureScale
from draftheads.heads.target import FrozenTarget, TargetIdentity, check_identity

FAMILY = "block"
CONTEXT_MODES = ("prefix", "kv")


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
    context: str = "prefix"  # prefix | kv (checkpoints without the field are prefix drafts)
    mask_token_id: int | None = None  # kv: the token whose frozen embedding fills mask entries
    draft_vocab_size: int = 0  # DV: rows of the draft's own (frozen) lm_head, mapped by d2t/t2d; 0: the target's head
    aux_scale: bool = False  # fc reads the context features times a fixed per-channel scale (heads/feature_scale.py)

    def __post_init__(self) -> None:
        if self.context not in CONTEXT_MODES:
            raise ValueError(f"head.context must be one of {', '.join(CONTEXT_MODES)}, got {self.context!r}")
        if self.context == "kv" and self.vocab_size and not (
                self.mask_token_id is not None and 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(f"head.mask_token_id must be a token id in [0, {self.vocab_size}) for head.context=kv, "
                             f"got {self.mask_token_id!r}")
        if self.num_layers < 1:
            raise ValueError(f"head.num_layers must be >= 1, got {self.num_layers}")
        if self.vocab_size and not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"head.draft_vocab_size must be in 1..{self.vocab_size} (the target's vocabulary) or "
                             f"null for the whole vocabulary, got {self.draft_vocab_size}")
        if self.block_size < 2:
            raise ValueError(f"head.block_size must be >= 2 (the root and at least one drafted token), "
                             f"got {self.block_size}")
        if self.num_target_layers:
            self.context_layers = check_aux_layers(self.context_layers, self.num_target_layers, "head.context_layers")


def default_mask_token(target: FrozenTarget) -> int:
    """A token that fills mask entries in ``context=kv``: the pad token when it is not the end-of-turn token, else
    the highest-id special token that is neither bos, eos nor pad, else the last vocabulary id."""
    cfg = target.config
    ends: set[int] = set()
    for name in ("eos_token_id", "bos_token_id"):
        v = getattr(cfg, name, None)
        ends |= set(v) if isinstance(v, (list, tuple)) else {v} if isinstance(v, int) else set()
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, int) and pad not in ends:
        return pad
    tok = target.tokenizer
    special = sorted(i for i in (getattr(tok, "all_special_ids", None) or [])
                     if i not in ends and i != pad and 0 <= i < target.vocab_size)
    return special[-1] if special else target.vocab_size - 1


def rms_scale(norm: nn.Module, hidden_size: int, eps: float) -> torch.Tensor | None:
    """The per-channel gain of an RMS norm of any family ([H]; Gemma stores it as 1 + w, Llama as w), read off its
    output for a unit input; None for a norm that centres (LayerNorm), whose gain this cannot recover."""
    w = next(iter(norm.parameters()), None)
    ones = torch.ones(1, hidden_size, dtype=torch.float32 if w is None else w.dtype,
                      device=None if w is None else w.device)
    with torch.no_grad():
        g = norm(ones).float()[0] * (1.0 + eps) ** 0.5  # [H]: a unit vector's RMS is 1, so this is the gain
    return g if bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0) else None


def block_config_for(target: FrozenTarget, context_layers: Sequence[int] | None = None, num_layers: int = 2,
                     block_size: int = 8, context: str = "prefix", mask_token_id: int | None = None,
                     draft_vocab_size: int = 0, aux_scale: bool = False) -> BlockConfig:
    L = target.num_layers
    # low/mid/high like EAGLE-3; shallow targets (under 7 layers) get the distinct ones of that choice
    layers = sorted({min(max(a, 0), L - 1) for a in default_aux_layers(L)}) if context_layers is None \
        else list(context_layers)
    return BlockConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=L,
                       context_layers=check_aux_layers(layers, L, "head.context_layers"), num_layers=int(num_layers),
                       block_size=int(block_size), layer_config=_layer_fields(target.config), context=context,
                       mask_token_id=(mask_token_id if mask_token_id is not None else default_mask_token(target))
                       if context == "kv" else None, draft_vocab_size=int(draft_vocab_size),
                       aux_scale=bool(aux_scale))


class BlockDraft(DraftVocabIds, FeatureScale, nn.Module):
    """Context entries fc(concat_l h_l) and block entries [embed(root), mask, ...] -> N decoder layers -> norm.

    What the layouts share lives here (config checks, ``fc`` and norms, the draft vocabulary, logits,
    checkpoints); how the context reaches the blocks is a subclass per ``config.context``, which
    ``BlockDraft(config, target)`` picks, so callers never branch on the layout. Layout methods: :meth:`block`
    (entries), :meth:`forward`, :meth:`rows` (training: every block of a batch in one forward) and
    :meth:`commit` / :meth:`run_block` (decoding against per-layer caches)."""

    def __new__(cls, config: BlockConfig | None = None, *args: Any, **kwargs: Any) -> "BlockDraft":
        if cls is BlockDraft:  # (a layout class itself, as copy and pickle call it, is built as it is)
            from draftheads.heads.block_layouts import LAYOUTS  # they subclass this one

            cls = LAYOUTS[config.context]
        return super().__new__(cls)

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
        base = _base(target)
        self.fc = nn.Linear(len(config.context_layers) * H, H, bias=False)
        self._init_feature_scale()  # with config.aux_scale, buffer aux_scale
        eps = float(getattr(lc, "rms_norm_eps", 1e-6))
        norm_cls = self._norm_class(base)
        self.context_norm = norm_cls(H, eps=eps)
        self.layer_config = self._build_layers(lc, target)
        self.norm = norm_cls(H, eps=eps)
        std = float(getattr(lc, "initializer_range", 0.02))
        for m in [self.fc, *self.layers.modules()]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self._init_extra(std)
        # start at the target's output scale: its lm_head reads its own final norm (SmolLM2's gains average 1.8; a
        # kv draft started at ones ended a 500-step run at 0.98, about half the target's logit scale). A same-class
        # norm is copied as stored (Gemma keeps w, the gain is 1 + w); another class gets the gain itself
        if isinstance(base.norm, norm_cls):
            self.norm.load_state_dict(base.norm.state_dict())
        else:
            scale = rms_scale(base.norm, H, eps)
            if scale is not None:
                with torch.no_grad():
                    self.norm.weight.copy_(scale)
        object.__setattr__(self, "_embed", target.embed_tokens())
        object.__setattr__(self, "_lm_head", target.lm_head())
        DV = config.draft_vocab_size
        if DV:  # the draft vocabulary's rows of the frozen head (set_vocab), and the id mapping
            self.lm_head = nn.Linear(H, DV, bias=False)
            self.lm_head.weight.requires_grad_(False)
            self.register_buffer("d2t", torch.zeros(DV, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
            self.set_vocab(torch.arange(DV))  # placeholder until the counted vocabulary (or a checkpoint) arrives

    # ------------------------------------------------------------------ what a layout provides
    def _norm_class(self, base: nn.Module) -> type[nn.Module]:
        raise NotImplementedError

    def _build_layers(self, lc: Any, target: FrozenTarget) -> Any:
        """Set ``self.layers`` (and the rotary tables) from the layer config ``lc``; return the config they use."""
        raise NotImplementedError

    def _init_extra(self, std: float) -> None:
        """Initialize the layout's own parameters beyond the Linear layers."""

    def block(self, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """[B, N] token ids and mask flags -> [B, N, H] block entries (a mask entry ignores its id)."""
        raise NotImplementedError

    def rows(self, ctx: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor, blk: torch.Tensor, blk_pos: torch.Tensor,
             blk_allowed: torch.Tensor) -> torch.Tensor:
        """Training: context entries [B, T, H] at positions and documents [B, T], block entries [B, S, H] at
        [B, S] that may see ``blk_allowed`` [B, S, T + S] (context, then blocks) -> [B, S, H] block outputs."""
        raise NotImplementedError

    def commit(self, x: torch.Tensor, pos: torch.Tensor, caches: Any) -> None:
        """Decoding: context entries [1, m, H] at positions [1, m] (causal among themselves) into ``caches``: one
        cache per layer, with ``update(k, v, layer_idx)``, ``crop(n)`` and ``filled()`` -> [(k, v)] per layer."""
        raise NotImplementedError

    def run_block(self, x: torch.Tensor, pos: torch.Tensor, caches: Any) -> torch.Tensor:
        """Decoding: block entries [1, n, H] at positions [1, n], seeing every committed entry and each other ->
        [1, n, H]; ``caches`` hold the committed entries only, before and after."""
        raise NotImplementedError

    def set_vocab(self, vocab_ids: Sequence[int] | torch.Tensor) -> None:
        """Use the draft vocabulary ``vocab_ids`` (target ids): the mapping, and the target lm_head's rows."""
        assert self.config.draft_vocab_size, "a draft over the whole vocabulary has no draft vocabulary"
        d2t, t2d = vocab_mapping(vocab_ids, self.config.vocab_size)
        if d2t.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {d2t.numel()} ids, head.draft_vocab_size is "
                             f"{self.config.draft_vocab_size}")
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            rows = self._lm_head.weight[self.target_ids().to(self._lm_head.weight.device)]  # [DV, H]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    @property
    def out_vocab(self) -> int:
        """Columns of :meth:`logits`: DV with a draft vocabulary, else the target's V."""
        return self.config.draft_vocab_size or self.config.vocab_size

    @property
    def attn_impl(self) -> str:
        return self.layer_config._attn_implementation

    def cast(self, dtype: torch.dtype) -> "BlockDraft":
        """Cast the trainable weights for inference; rotary frequencies stay fp32."""
        for m in (self.fc, self.context_norm, self.layers, self.norm, getattr(self, "lm_head", None)):
            if m is not None:
                m.to(dtype)
        return self

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., n_layers·H] target hidden states (concatenated in ``context_layers`` order) -> [.., H] entries."""
        return self.context_norm(self.fc_in(hidden))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] draft outputs -> [.., out_vocab]: the target's frozen lm_head, or its draft-vocabulary rows."""
        head = self.frozen_lm_head()
        return head(h.to(head.weight.dtype))

    def frozen_lm_head(self) -> nn.Module:
        """The frozen output projection (over the draft vocabulary when there is one): what the loss reads."""
        return self.lm_head if self.config.draft_vocab_size else self._lm_head

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
        check_layer_fields(config.layer_config, target, where)
        if config.draft_vocab_size:
            check_vocab_mapping(tensors.get("d2t"), tensors.get("t2d"), config.draft_vocab_size, config.vocab_size,
                                where)
        return load_draft_weights(cls(config, target), tensors, where)

