"""What the two feature-draft entries (train/eagle.py, train/eagle3.py) share, where the logic is the same.

- ``draft_sequence``: positions and causal (per-document) mask of the draft's teacher-forced sequence.
- ``feature_source``: online or offline (``features.dir``) training features; held-out rows always online.
- ``feature_rms`` / ``fix_aux_scale``: per-channel RMS of the target's features over the first training rows, and
  the fixed input scale of a fresh draft's ``fc`` (heads/feature_scale.py; EAGLE-3 and the block draft).
- ``heldout_stat_means`` / ``heldout_evaluator``: the objective's own forward stats averaged over the first
  held-out rows, in lockstep over ranks (ZeRO-3/FSDP forwards are collective), recorded in the checkpoint.

What only looks alike (the objectives' losses, acceptance ranks, draft construction) stays in each entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from draftheads.data_prep.dataset import collate, shifted_valid
from draftheads.data_prep.features import batch_hidden, training_features
from draftheads.train.loop import lockstep_batches


def draft_sequence(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, T-1] and causal (per-document) mask [B, T-1, T-1] of the draft's sequence: draft position t
    reads the pair at t (target features at t, token x_{t+1}); packed rows restart positions per document and
    never attend across documents."""
    ids = batch["input_ids"]
    B, T = ids.shape
    S = T - 1
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    if "doc_ids" in batch:
        doc = batch["doc_ids"][:, :S]
        return batch["position_ids"][:, :S], causal[None] & (doc[:, :, None] == doc[:, None, :])
    return torch.arange(S, device=ids.device)[None].expand(B, S), causal[None].expand(B, S, S)


@torch.no_grad()
def feature_rms(rows: Any, collate_fn: Callable, target: Any, layers: Sequence[int], acc: Any,
                max_tokens: int = 16384, batch_size: int = 4) -> tuple[torch.Tensor, int]:
    """(per-channel RMS [len(layers)·H] fp32 of the concatenated features, tokens read): the target's features at
    the labelled draft positions (``shifted_valid(batch, 2)``) of the first training rows, up to ~max_tokens.
    Every rank reads the same rows, so every rank gets the same numbers and runs the same forwards (ZeRO-3/FSDP
    forwards are collective). Channels that never move are clamped to 1% of the median RMS."""
    sq: torch.Tensor | None = None
    n, start = 0, 0
    with acc.autocast():
        while n < max_tokens and start < len(rows):
            batch = {k: v.to(acc.device) for k, v in
                     collate_fn([rows[j] for j in range(start, min(start + batch_size, len(rows)))]).items()}
            start += batch_size
            hidden = batch_hidden(batch, target, layers)
            valid = shifted_valid(batch, 2)  # [B, T-2]
            x = torch.cat([hidden[l][:, : valid.shape[1]][valid] for l in layers], dim=-1).double()  # [n, C]
            sq = x.pow(2).sum(0) if sq is None else sq + x.pow(2).sum(0)
            n += x.shape[0]
    if sq is None or n == 0:
        raise ValueError(f"no labelled (assistant) tokens in the first {start} training rows: cannot estimate the "
                         f"feature scale; check data.* (the loss mask) or set head.aux_scale=false")
    rms = (sq / n).sqrt().float()
    return rms.clamp_min(float(rms.median()) * 1e-2), n


AUTO_SCALE_MIN_RATIO = 300.0  # head.aux_scale=auto applies the scale from this largest/median channel RMS up


def aux_scale_mode(value: Any, key: str = "head.aux_scale") -> bool | str:
    """true | false | auto (the default): the draft's feature-scale switch, checked."""
    if value is None or isinstance(value, bool) or value == "auto":
        return "auto" if value is None else value
    raise ValueError(f"{key}={value!r}: allowed values are true, false and auto")


def fix_aux_scale(draft: Any, feats: "FeatureSource", target: Any, layers: Sequence[int], acc: Any,
                  fresh: bool, mode: bool | str = True) -> dict[str, Any]:
    """A fresh draft with ``aux_scale`` reads unit-RMS feature channels: the scale is 1/RMS over the first training
    rows' labelled tokens, fixed before the first step (a resumed or fine-tuned draft keeps its checkpoint's).
    ``mode="auto"`` applies it only where the largest channel's RMS is at least AUTO_SCALE_MIN_RATIO times the
    median's, and otherwise leaves the scale at ones (raw features, the same numbers as a draft without it): on
    Gemma 3 270M (ratio ~750) it lifted the EAGLE-3 head's τ from 1.66 to 2.60; on SmolLM2-135M (~118) a block draft
    trained no better with it. Returns what the checkpoint records about it."""
    if not draft.config.aux_scale:
        return {"aux_scale": False}
    if not fresh:
        return {"aux_scale": "checkpoint"}
    rms, n = feature_rms(feats.train, feats.collate, target, layers, acc)
    ratio = float(rms.max() / rms.median())
    applied = mode is True or ratio >= AUTO_SCALE_MIN_RATIO
    draft.set_aux_scale(1.0 / rms if applied else torch.ones_like(rms))
    return {"aux_scale": {"mode": "auto" if mode == "auto" else "on", "applied": applied, "tokens": n,
                          "max_over_median_rms": round(ratio, 2)}}


@dataclass
class FeatureSource:
    train: Any  # the training rows (online) or rows + cached features (offline)
    collate: Callable  # the training collate
    heldout_collate: Callable  # held-out metrics and the simulated τ: always online (the target runs)
    source: str  # "online" | "offline:<dir>"


def feature_source(cfg: Any, target: Any, data: Any, layers: Sequence[int]) -> FeatureSource:
    """Training features as ``cfg.features.dir`` asks (checked against the target, layers and data)."""
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    features_dir = cfg.get("features", {}).get("dir")
    train, batch_fn, source = training_features(features_dir, target, data, layers, pad_id)
    return FeatureSource(train, batch_fn, lambda rows: collate(rows, pad_id), source)


def heldout_rows(heldout: Any, max_tokens: int) -> int:
    """How many leading held-out rows make ~max_tokens tokens (the row that crosses the budget included; 0 for
    a budget of 0 or an empty split). The same on every rank."""
    n, seen = 0, 0
    for x in (heldout["input_ids"] if heldout is not None and len(heldout) else []):
        if seen >= max_tokens:
            break
        seen += len(x)
        n += 1
    return n


@torch.no_grad()
def heldout_stat_means(objective: Any, heldout: Any, batch_fn: Callable, acc: Any, max_tokens: int,
                       names: Mapping[str, str] | None = None) -> dict[str, float]:
    """Means of the objective's forward stats (``name -> (sum, count)``, eval mode: no noise) over the first
    held-out rows up to ~max_tokens tokens, summed over ranks. Every rank runs the same number of batches
    (``lockstep_batches``). Output keys: ``names[stat]`` for the stats named there (others dropped), else
    ``heldout_<stat with / as _>`` for every stat; stats without any count are left out."""
    was = objective.training
    objective.eval()
    sums: dict[str, list[float]] = {}
    with acc.autocast():
        for idx, counted in lockstep_batches(heldout_rows(heldout, max_tokens), 4, acc):
            b = {k: v.to(acc.device) for k, v in batch_fn([heldout[j] for j in idx]).items()}
            _, st = objective(b)
            for k, (s, c) in st.items():
                if names is not None and k not in names:
                    continue
                p = sums.setdefault(k, [0.0, 0.0])
                if counted:
                    p[0] += float(s)
                    p[1] += float(c)
    objective.train(was)
    keys = sorted(names) if names is not None else sorted(sums)  # the same keys on every rank, even with no rows
    vec = torch.tensor([sums.get(k, [0.0, 0.0])[j] for k in keys for j in (0, 1)], dtype=torch.float64)
    if acc.num_processes > 1:
        vec = acc.reduce(vec.to(acc.device), "sum").cpu()
    out = {}
    for i, k in enumerate(keys):
        if vec[2 * i + 1] > 0:
            name = names[k] if names is not None else "heldout_" + k.replace("/", "_")
            out[name] = float(vec[2 * i] / vec[2 * i + 1])
    return out


def heldout_evaluator(objective: Any, heldout: Any, batch_fn: Callable, acc: Any, max_tokens: int,
                      extra: dict[str, Any], names: Mapping[str, str] | None = None) -> Callable[[int], dict]:
    """The Trainer's ``evaluate``: ``heldout_stat_means``, also recorded (rounded) as ``extra["heldout"]``, which
    the next checkpoint writes into its config.json."""
    def evaluate(step: int) -> dict[str, Any]:
        m = heldout_stat_means(objective, heldout, batch_fn, acc, max_tokens, names)
        if m:
            extra["heldout"] = {k: round(v, 5) for k, v in m.items()}
        return m

    return evaluate
