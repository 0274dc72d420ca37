"""Medusa heads (Cai et al., 2024): K extra heads on the target's last hidden state.

Head k (1-based) at position t predicts token t+k+1; the target's own lm_head covers t+1. Each
head is N residual blocks ``x + SiLU(W x + b)`` followed by an output projection. The blocks start
at W = 0, b = 0 so an untrained head equals the target's own next-token head ("identity init"),
and training only has to learn the shift.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftheads.heads.checkpoint import read_head, save_head
from draftheads.heads.target import FrozenTarget, TargetIdentity, check_identity

FAMILY = "medusa"


@dataclass
class MedusaConfig:
    """Architecture of a set of Medusa heads (saved in every checkpoint)."""

    num_heads: int = 4  # K: head k predicts token t+k+1
    num_layers: int = 1  # residual blocks per head
    hidden_size: int = 0  # the target's hidden size (filled from the target)
    vocab_size: int = 0  # the target's vocabulary (filled from the target)
    share_lm_head: bool = False  # True: every head reuses the target's frozen lm_head (saves K·V·H params)

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"head.num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"head.num_layers must be >= 0, got {self.num_layers}")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), zero-initialized so it starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; ``forward`` maps target hidden states [.., H] to K logit tensors [K, .., V]."""

    def __init__(self, config: MedusaConfig, target_lm_head: nn.Module):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        assert target_lm_head.weight.shape == (V, H), (target_lm_head.weight.shape, V, H)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)]) for _ in range(config.num_heads))
        if config.share_lm_head:
            # Not registered: the frozen projection is the target's, never trained nor saved.
            object.__setattr__(self, "_shared_lm_head", target_lm_head)
            self.lm_heads = None
        else:
            heads = []
            for _ in range(config.num_heads):
                lin = nn.Linear(H, V, bias=False)
                with torch.no_grad():
                    lin.weight.copy_(target_lm_head.weight.float())
                heads.append(lin)
            self.lm_heads = nn.ModuleList(heads)

    def head_hidden(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden state of head k (0-based) after its residual blocks: [.., H] -> [.., H]."""
        return self.blocks[k](hidden)

    def shared_projection(self) -> nn.Module | None:
        """The target's frozen lm_head when every head shares it (training's fused loss uses it), else None."""
        return self._shared_lm_head if self.lm_heads is None else None

    def project(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Logits of head k (0-based) from its hidden state: [.., H] -> [.., V]."""
        if self.lm_heads is None:
            return self._shared_lm_head(h.to(self._shared_lm_head.weight.dtype))
        return self.lm_heads[k](h)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """All heads' logits: [.., H] -> [K, .., V]."""
        return torch.stack([self.project(k, self.head_hidden(k, hidden)) for k in range(self.config.num_heads)])

    # ------------------------------------------------------------------ checkpoints
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | Path, target: TargetIdentity, extra: dict[str, Any] | None = None) -> Path:
        return save_head(path, FAMILY, asdict(self.config), target.to_dict(), self.trainable_state_dict(), extra)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: FrozenTarget, allow_target_mismatch: bool = False,
                        ) -> "MedusaHeads":
        cfg, tensors = read_head(path, FAMILY)
        check_identity(cfg["target"], target.identity, f"Medusa checkpoint {path}",
                       strict_fingerprint=not allow_target_mismatch)
        config = MedusaConfig(**cfg["head_config"])
        heads = cls(config, target.lm_head())
        missing, unexpected = heads.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"Medusa checkpoint {path} does not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        return heads


def medusa_config_for(target: FrozenTarget, num_heads: int, num_layers: int, share_lm_head: bool) -> MedusaConfig:
    return MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=target.hidden_size,
                        vocab_size=target.vocab_size, share_lm_head=share_lm_head)
