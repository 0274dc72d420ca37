"""The draft vocabulary of an EAGLE-3 head: its size, and the ``d2t``/``t2d`` mapping between draft and target ids
that every checkpoint carries and every load validates.

Apart from the module (heads/eagle3.py) because export and the vocabulary tools check or size a draft vocabulary
without building a draft.
"""

from __future__ import annotations

from typing import Sequence

import torch

DEFAULT_DRAFT_VOCAB = 32000


def resolve_draft_vocab_size(requested: int | None, vocab_size: int) -> int:
    """null -> min(32000, V); an explicit size larger than V is an error, not silently capped."""
    if requested is None:
        return min(DEFAULT_DRAFT_VOCAB, vocab_size)
    requested = int(requested)
    if requested > vocab_size:
        raise ValueError(f"head.draft_vocab_size={requested} is larger than the target's vocabulary ({vocab_size}); "
                         f"use at most {vocab_size} (or null for min({DEFAULT_DRAFT_VOCAB}, V))")
    if requested < 1:
        raise ValueError(f"head.draft_vocab_size must be >= 1, got {requested}")
    return requested


def vocab_mapping(vocab_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [DV] int64, t2d [V] bool) from the draft vocabulary's target ids.

    The ids are sorted first: draft id i is then the i-th smallest target id, which is the order in
    which serving engines select lm_head rows with ``t2d`` (``W[t2d]``), so the rows line up.
    """
    ids = torch.as_tensor(vocab_ids, dtype=torch.int64).sort().values
    if ids.numel() == 0:
        raise ValueError("empty draft vocabulary")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be in 0..{vocab_size - 1}, got {int(ids[0])}..{int(ids[-1])}")
    if bool((ids[1:] == ids[:-1]).any()):
        raise ValueError("draft vocabulary ids repeat")
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids_of(t2d: torch.Tensor) -> torch.Tensor:
    """[V] the draft id of every target id (-1 outside the draft vocabulary), from ``t2d`` [V] bool."""
    return torch.where(t2d, t2d.long().cumsum(0) - 1, -1)


class DraftVocabIds:
    """Id mapping for a draft module with a ``d2t`` buffer and ``config.draft_vocab_size`` (0: no draft vocabulary,
    its columns are target ids): shared by the EAGLE-3 and block drafts."""

    d2t: torch.Tensor
    config: object

    def target_ids(self) -> torch.Tensor:
        """[DV] the target id of each draft id (d2t is an offset: draft id i is target id i + d2t[i])."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> target ids."""
        return ids + self.d2t[ids] if self.config.draft_vocab_size else ids


def check_vocab_mapping(d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab_size: int, vocab_size: int,
                        where: str) -> None:
    """Refuse a missing or inconsistent mapping with an error naming what is wrong."""
    missing = [n for n, t in (("d2t", d2t), ("t2d", t2d)) if t is None]
    if missing:
        raise ValueError(f"{where} has no {' / '.join(missing)}: the draft-vocabulary mapping is part of an EAGLE-3 "
                         f"checkpoint (its lm_head rows belong to it) and is never rebuilt from data; use the complete "
                         f"checkpoint directory")
    assert d2t is not None and t2d is not None
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(f"{where}: d2t must be int64 of shape ({draft_vocab_size},) (draft_vocab_size), "
                         f"got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise ValueError(f"{where}: t2d must be bool of shape ({vocab_size},) (the target's vocabulary), "
                         f"got {t2d.dtype} {tuple(t2d.shape)}")
    ids = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError(f"{where}: d2t does not map draft ids to increasing target ids in 0..{vocab_size - 1}")
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[ids].all()):
        raise ValueError(f"{where}: d2t and t2d disagree (t2d marks {int(t2d.sum())} target ids, d2t maps "
                         f"{draft_vocab_size} draft ids to {int(t2d[ids].sum())} of them)")
