"""Draft-vocabulary statistics: which target token ids an EAGLE-3 draft's lm_head covers.

The draft predicts assistant tokens only, so the vocabulary is the ``DV`` most frequent ids among the
loss-masked (assistant) tokens of the prepared training split — ties broken by the smaller id — and
then sorted by id (see heads.eagle3.vocab_mapping). Ids never seen fill the remaining slots in id
order, so any DV <= V is valid. Coverage (share of assistant tokens inside the vocabulary) is
reported so a too-small DV is visible before training.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def count_assistant_tokens(dataset: Any, vocab_size: int) -> np.ndarray:
    """[V] int64 counts of every token id where loss_mask == 1 (rows of a prepared split)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    ids_col, mask_col = dataset["input_ids"], dataset["loss_mask"]
    for ids, mask in zip(ids_col, mask_col):
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        sel = ids[mask]
        if sel.size and (sel.max() >= vocab_size or sel.min() < 0):
            raise ValueError(f"token id {int(sel.max())} in the training data is outside the target's vocabulary "
                             f"(0..{vocab_size - 1}): the data was tokenized for another model")
        counts += np.bincount(sel, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The ``draft_vocab_size`` most frequent ids (ties: smaller id first), sorted by id. [DV] int64."""
    V = counts.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{V} (the target's vocabulary)")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def vocab_stats(counts: np.ndarray, vocab_ids: np.ndarray,
                heldout_counts: np.ndarray | None = None) -> dict[str, Any]:
    """Coverage numbers recorded in the checkpoint and the log.

    Training coverage is 1.0 whenever DV exceeds the distinct ids seen, which says nothing about new text;
    ``heldout_coverage`` (assistant tokens of the held-out split inside the vocabulary) is the honest estimate
    of how often the draft *can* propose the next token.
    """
    total = int(counts.sum())
    inside = int(counts[vocab_ids].sum())
    out = {"draft_vocab_size": int(vocab_ids.size), "assistant_tokens": total,
           "distinct_assistant_ids": int((counts > 0).sum()),
           "coverage": round(inside / total, 6) if total else None}
    if heldout_counts is not None and int(heldout_counts.sum()):
        out["heldout_coverage"] = round(int(heldout_counts[vocab_ids].sum()) / int(heldout_counts.sum()), 6)
    return out
