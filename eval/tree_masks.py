"""The attention masks of a tree verification forward, one per kind of decoder layer.

Why apart from generate.py: a tree forward hands the target a ready [N, cur+N] mask, and targets with
sliding-window layers (Gemma 2/3, Mistral, Phi-3, gpt-oss) need that mask cut to each layer type's window, in the
form (bool or additive) the attention implementation takes as it is.
"""

from __future__ import annotations

from typing import Any

import torch


def layer_masks(full: torch.Tensor, depths: torch.Tensor, cur: int, target: Any) -> Any:
    """The tree mask ``full`` [N, cur+N] ready for the target: one [1, 1, N, cur+N] mask when every layer is of one
    type; for mixed layer types (Gemma 2/3, Qwen2 max_window_layers, gpt-oss) the models' {layer type: mask} form,
    which they take as their per-type masks."""
    windows = attention_windows(target.config)
    masks = {kind: ready_mask(windowed(full, depths, cur, w), target) for kind, w in windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


ATTENTION_KINDS = ("full_attention", "sliding_attention")


def attention_windows(config: Any) -> dict[str, int | None]:
    """{layer type: sliding window (None = full attention)} of a target's decoder layers.

    Why: a tree forward hands the model a ready [N, cur+N] mask, which transformers uses as it is on every layer;
    a sliding-window layer must not see keys more than ``window - 1`` positions back, so its mask is cut here the
    way transformers cuts its own (key position > query position - window). Layer types as transformers' caches
    read them: ``layer_types`` if the config has it, else every layer sliding when ``sliding_window`` is set
    (Mistral, Phi-3)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"]
    odd = sorted(set(types) - set(ATTENTION_KINDS))
    if odd:
        raise ValueError(f"target model_type {getattr(cfg, 'model_type', '?')!r} has decoder layers of type {odd}; "
                         f"tree verification supports {list(ATTENTION_KINDS)}")
    return {t: (int(window) if t == "sliding_attention" and window else None) for t in dict.fromkeys(types)}


def ready_mask(allowed: torch.Tensor, target: Any) -> torch.Tensor:
    """[N, K] bool (True = may attend) -> the [1, 1, N, K] mask the target's attention takes as it is: bool for sdpa,
    additive float for eager (eager adds the mask to the scores: a bool one would add 0 or 1 and mask nothing)."""
    impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
    m = allowed[None, None]
    if impl == "sdpa":
        return m
    if impl == "eager":
        dtype = target.dtype
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
    raise ValueError(f"tree verification needs the target's attn_implementation to be sdpa or eager (a mask per "
                     f"tree node); it is {impl!r}")


def windowed(full: torch.Tensor, depths: torch.Tensor, cur: int, window: int | None) -> torch.Tensor:
    """The tree mask [N, cur+N] of a layer that sees only keys less than ``window`` positions back.

    Node i sits at position cur + depths[i]; prefix key j at position j, tree key k at cur + depths[k]."""
    if window is None:
        return full
    kpos = torch.cat([torch.arange(cur, device=full.device), cur + depths])  # [cur+N] key positions
    qpos = cur + depths  # [N]
    return full & (qpos[:, None] - kpos[None, :] < window)
