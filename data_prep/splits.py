"""Train/held-out splits and duplicates of loaded conversations: the normalized keys that say two conversations (or
two prompts) are the same, dropping repeats, and the deterministic hash split.

Apart from loading (:mod:`data_prep.sources`) because every consumer that must keep held-out prompts out of
training (the dataset, distillation's shards and eval-prompt exclusion) keys on the same normalization.
"""

from __future__ import annotations

import hashlib
import logging
import unicodedata
from typing import Iterable

from draftheads.data_prep.sources import Conversation

logger = logging.getLogger(__name__)


def _unit_hash(seed: int, conv_id: str) -> float:
    h = hashlib.sha256(f"{seed}:{conv_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


SPLIT_BY = ("prompt", "id")


def _norm_text(text: str) -> str:
    """Casefolded, NFKC, whitespace-collapsed text: the equality used for duplicate detection."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def prompt_key(c: Conversation) -> str:
    """The normalized first user message (the conversation id when there is none).

    ShareGPT repeats openers ("continue", "hi", popular prompts) across conversation ids, and first-turn
    self-distillation answers identical openers identically; keying the split on the opener keeps every
    copy on one side, so a held-out prompt was never trained on.
    """
    first = next((m["content"] for m in c.messages if m["role"] == "user"), None)
    return "prompt:" + _norm_text(first) if first is not None else "id:" + c.id


def conversation_key(c: Conversation) -> str:
    """Digest of the normalized (role, content) sequence: equal keys = the same conversation."""
    h = hashlib.sha256()
    for m in c.messages:
        h.update(m["role"].encode() + b"\x00" + _norm_text(m["content"]).encode("utf-8", "surrogatepass") + b"\x01")
    return h.hexdigest()


def dedupe_conversations(convs: Iterable[Conversation]) -> tuple[list[Conversation], int]:
    """Drop conversations equal (after normalization) to an earlier one; returns ``(kept, n_dropped)``.

    Duplicates over-weight one text in training and, split apart, leak it into the held-out set.
    """
    seen: set[str] = set()
    kept: list[Conversation] = []
    dropped = 0
    for c in convs:
        k = conversation_key(c)
        if k in seen:
            dropped += 1
            continue
        seen.add(k)
        kept.append(c)
    if dropped:
        logger.info("dedupe_conversations: dropped %d duplicate conversations, kept %d", dropped, len(kept))
    return kept, dropped


def split_conversations(convs: Iterable[Conversation], heldout_fraction: float,
                        seed: int = 0, by: str = "prompt") -> tuple[list[Conversation], list[Conversation]]:
    """Split into ``(train, heldout)`` deterministically by a hash of each conversation's split key.

    ``by="prompt"`` (default) keys on the normalized first user message, so conversations opening with the
    same text (any id, case or spacing) share a split; ``by="id"`` keys on the conversation id (ids shared
    by several conversations land together). A conversation is held out iff ``sha256(f"{seed}:{key}")``
    mapped to [0, 1) is below ``heldout_fraction``, so membership does not depend on order or on which
    other conversations are present. The training part keeps input order; the held-out part comes in a fixed
    hash order of ids, because its consumers read prefixes (the trainer's simulated τ and held-out metrics,
    eval's ``max_questions``) and source files are often sorted (the distill job writes batches by prompt
    length), so an input-order prefix would be the shortest prompts rather than a sample of the split.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    if by not in SPLIT_BY:
        raise ValueError(f"split key must be one of {list(SPLIT_BY)}, got {by!r}")
    train: list[Conversation] = []
    held: list[Conversation] = []
    keys: set[str] = set()
    dups = 0
    for c in convs:
        k = prompt_key(c) if by == "prompt" else c.id
        if k in keys:
            dups += 1
        keys.add(k)
        (held if _unit_hash(seed, k) < heldout_fraction else train).append(c)
    if dups:
        logger.info("split_conversations: %d conversations share a split key (%s) with an earlier one; "
                    "they land in the same split", dups, by)
    logger.info("split_conversations: %d train / %d held out (fraction %.3f, seed %d, by %s)",
                len(train), len(held), heldout_fraction, seed, by)
    held.sort(key=lambda c: hashlib.sha256(f"heldout-order:{c.id}".encode("utf-8", "surrogatepass")).digest())
    return train, held
