"""A fixed per-channel scale on the target features a draft's ``fc`` reads (EAGLE-3's aux layers, the block draft's
context layers): shared by both families.

Why: a target may carry a few residual channels far larger than the rest. On Gemma 3 270M (aux layers 2, 9, 15) one
channel holds about two thirds of the energy of the three concatenated features, and the largest channel's RMS is
~750x the median channel's (SmolLM2-135M: 38% and ~110x). ``fc`` then outputs mostly that channel, and the norm
after it divides everything else away; an EAGLE-3 head trained 240 steps that way still took 91% of fc's output energy from six channels. Training on channels
scaled to unit RMS (the scale fixed from the first training rows, before step 1) removes that detour. Where no
channel stands out that far it is not free: ``head.aux_scale=auto`` (train/common.py:fix_aux_scale) applies it from
a largest/median RMS ratio of 300 up and otherwise keeps the scale at ones. The scale is linear, so an export folds
it into ``fc.weight`` (:meth:`FeatureScale.exported_state_dict`) and serving engines, which feed raw features,
compute the same thing.

A module using it has ``self.fc`` and ``self.config.aux_scale`` and calls :meth:`FeatureScale._init_feature_scale`
after building ``fc``; the scale is a persistent fp32 buffer ``aux_scale`` (saved with the weights, never cast).
"""

from __future__ import annotations

import torch
from torch import nn


class FeatureScale:
    fc: nn.Linear
    config: object

    def _init_feature_scale(self) -> None:
        if self.config.aux_scale:  # type: ignore[attr-defined]
            self.register_buffer("aux_scale", torch.ones(self.fc.in_features))  # type: ignore[attr-defined]

    @torch.no_grad()
    def set_aux_scale(self, scale: torch.Tensor) -> None:
        """Fix the per-channel scale (fresh drafts, before training): 1/RMS per channel."""
        assert self.config.aux_scale, "the draft was built without aux_scale"  # type: ignore[attr-defined]
        assert scale.shape == self.aux_scale.shape and bool(torch.isfinite(scale).all()), scale.shape
        self.aux_scale.copy_(scale)

    def fc_in(self, features: torch.Tensor) -> torch.Tensor:
        """[.., C] raw concatenated target features -> fc(features × scale) [.., H]."""
        if self.config.aux_scale:  # type: ignore[attr-defined]
            features = features.float() * self.aux_scale  # [.., C]
        return self.fc(features.to(self.fc.weight.dtype))

    def folded_fc_weight(self) -> torch.Tensor:
        """fc.weight with the scale folded in [H, C] fp32: what an engine that feeds raw features needs."""
        w = self.fc.weight.detach().float()
        return w * self.aux_scale[None] if self.config.aux_scale else w  # type: ignore[attr-defined]

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """state_dict as an engine reads it: no aux_scale, and fc.weight with it folded in (fp32)."""
        return {k: self.folded_fc_weight() if k == "fc.weight" else v
                for k, v in self.state_dict().items() if k != "aux_scale"}  # type: ignore[attr-defined]
