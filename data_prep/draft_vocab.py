"""Draft-vocabulary statistics: which target token ids a draft's own lm_head covers (EAGLE-3, the block draft).

The draft predicts assistant tokens only, so the vocabulary is the ``DV`` most frequent ids among the
loss-masked (assistant) tokens of the prepared training split — ties broken by the smaller id — and
then sorted by id (see heads.eagle3_vocab.vocab_mapping). Ids never seen fill the remaining slots in id
order, so any DV <= V is valid. Coverage (share of assistant tokens inside the vocabulary) is
reported so a too-small DV is visible before training.

A small training set (a thousand self-distilled answers) sees only a few thousand distinct ids, and the
ids it happens to miss are guaranteed rejections on new text. ``head.draft_vocab_reference`` names a
larger corpus (the embedded ShareGPT, or any conversations file) whose assistant turns also vote: ids
are ranked by the mean of the two normalized frequencies, so common tokens the training split never
saw get slots, and the target's own frequent tokens keep theirs. Tokenizing a whole corpus takes a while
(92 s for ShareGPT's 18.8M assistant tokens on one busy CPU core, on every rank), so the counts are cached under
``$DRAFTHEADS_CACHE/vocab_ref``, keyed by the file (path, size, mtime), the tokenizer and V.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


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


def _reference_cache_file(source: str, tokenizer: Any, vocab_size: int) -> Path | None:
    """Where the counts of ``source`` are cached; None when it is not an existing file (the loader then says why)."""
    from draftheads.data_prep.dataset import file_identity, tokenizer_fingerprint
    from draftheads.data_prep.sources import sharegpt_path
    from draftheads.heads.target_source import cache_root

    path = Path(sharegpt_path() if source == "sharegpt" else os.path.expanduser(source))
    if not path.is_file():
        return None
    blob = json.dumps({"v": 1, **file_identity(path), "tok": tokenizer_fingerprint(tokenizer), "V": vocab_size},
                      sort_keys=True)
    return cache_root() / "vocab_ref" / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"


def count_reference_tokens(source: str, tokenizer: Any, vocab_size: int, batch: int = 512) -> np.ndarray:
    """[V] int64 counts of the tokens of every assistant message of a conversations corpus (content only, no
    chat template: the template's tokens are in the training counts already). ``source``: "sharegpt" (the
    embedded file) or a path that data_prep.sources reads. Cached (see the module docstring)."""
    from draftheads.heads.checkpoint import atomic_write_text

    cached = _reference_cache_file(source, tokenizer, vocab_size)
    if cached is not None and cached.is_file():
        ids, n = json.loads(cached.read_text())["counts"]
        counts = np.zeros(vocab_size, dtype=np.int64)
        counts[np.asarray(ids, dtype=np.int64)] = n
        return counts
    counts = _count_reference_tokens(source, tokenizer, vocab_size, batch)
    if cached is not None:
        nz = np.flatnonzero(counts)
        atomic_write_text(cached, json.dumps({"source": source, "counts": [nz.tolist(), counts[nz].tolist()]}))
    return counts


def _count_reference_tokens(source: str, tokenizer: Any, vocab_size: int, batch: int) -> np.ndarray:
    from draftheads.data_prep.sources import load_conversations  # the loader's own errors name file, record and field

    try:
        convs, _ = load_conversations(source)
    except (ValueError, OSError) as e:  # unknown name, missing file, nothing parseable: say which setting
        raise ValueError(f"head.draft_vocab_reference={source!r}: {e} (use 'sharegpt' for the embedded ShareGPT "
                         "or a path to a conversations file)") from None
    texts = [m["content"] for c in convs for m in c.messages if m["role"] == "assistant" and m["content"]]
    if not texts:
        raise ValueError(f"head.draft_vocab_reference={source!r} has no assistant text to count")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(0, len(texts), batch):
        ids = tokenizer(texts[i:i + batch], add_special_tokens=False)["input_ids"]
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
        if flat.size and flat.max() >= vocab_size:
            raise ValueError(f"the tokenizer gives id {int(flat.max())} for head.draft_vocab_reference={source!r}, "
                             f"outside the target's vocabulary (0..{vocab_size - 1})")
        counts += np.bincount(flat, minlength=vocab_size)
    return counts


def ranking_scores(counts: np.ndarray, reference: np.ndarray | None) -> np.ndarray:
    """What select_draft_vocab ranks by: the training counts alone, or the mean of the training and the
    reference corpus's normalized frequencies (each corpus weighs the same, whatever its size). [V]"""
    if reference is None:
        return counts
    assert reference.shape == counts.shape
    train = counts / max(1, int(counts.sum()))
    return 0.5 * train + 0.5 * reference / max(1, int(reference.sum()))


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The ``draft_vocab_size`` highest-scoring ids (counts or ranking_scores; ties: smaller id first), sorted
    by id. [DV] int64."""
    V = counts.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{V} (the target's vocabulary)")
    order = np.lexsort((np.arange(V), -counts))  # by count descending, then id ascending
    return np.sort(order[:draft_vocab_size]).astype(np.int64)


def vocab_stats(counts: np.ndarray, vocab_ids: np.ndarray, heldout_counts: np.ndarray | None = None,
                reference_counts: np.ndarray | None = None) -> dict[str, Any]:
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
    if reference_counts is not None and int(reference_counts.sum()):
        out["reference_tokens"] = int(reference_counts.sum())
        out["reference_coverage"] = round(int(reference_counts[vocab_ids].sum()) / out["reference_tokens"], 6)
    return out


HELDOUT_COVERAGE_WARN = 0.97  # warn below this share of held-out assistant tokens inside the draft vocabulary


def counted_vocab(data: Any, tokenizer: Any, vocab_size: int, draft_vocab_size: int, reference: str | None,
                  ) -> tuple[np.ndarray, dict[str, Any]]:
    """(vocab ids [DV] sorted, info for the checkpoint and log): the draft vocabulary a fresh draft starts with,
    counted on ``data.train`` (and ``reference``'s assistant turns when given), with its coverage numbers; warns when
    it covers too little of the held-out split. Shared by every family with a draft vocabulary."""
    counts = count_assistant_tokens(data.train, vocab_size)
    ref = count_reference_tokens(str(reference), tokenizer, vocab_size) if reference else None
    vocab = select_draft_vocab(ranking_scores(counts, ref), draft_vocab_size)
    held = count_assistant_tokens(data.heldout, vocab_size) if data.heldout is not None and len(data.heldout) else None
    info = {"source": "counted", **vocab_stats(counts, vocab, held, ref)}
    if ref is not None:
        info["reference"] = str(reference)
    if info.get("heldout_coverage") is not None and info["heldout_coverage"] < HELDOUT_COVERAGE_WARN:
        log.warning(
            "the draft vocabulary (%d ids) covers only %.1f%% of the held-out assistant tokens: every other token is "
            "a guaranteed rejection; a larger head.draft_vocab_size removes those at the cost of a larger draft "
            "lm_head, and head.draft_vocab_reference=sharegpt fills the slots the training split leaves with common "
            "tokens", draft_vocab_size, 100 * info["heldout_coverage"])
    return vocab, info
