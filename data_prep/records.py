"""Stream records out of real-world JSON files: arrays (also cut off mid-record), JSON Lines, wrapper objects.

What a data file looks like in practice decides this module's shape: the embedded ShareGPT V3 dump is a JSON
array cut off inside a record, hand-edited files carry ``//`` comments or a broken record, and a single byte that
is not UTF-8 must cost one record, not the file. Layouts are detected from the content (``.jsonl``/``.ndjson``
extensions force JSON Lines):

* a JSON array of records -- streamed record by record; a file cut off mid-record yields everything complete
  before the cut (``LoadStats.truncated_tail``); text that is no record (a broken record, a ``//`` comment, a
  stray bracket, junk between records) is skipped up to the next complete record, whatever its indentation, and
  counted (``bad_json``);
* JSON Lines, one record per line (a malformed line is skipped and counted, or raises with its line number);
* a JSON object holding the list of records under a key such as ``"data"`` (``"data"``, ``"conversations"``,
  ``"records"``, ... or the only list of record-like objects), or a single record object.

A byte that is not UTF-8 costs only the record (or JSONL line) holding it: skipped and counted as
``bad_encoding`` with its exact line, or raised. :mod:`sources` turns the records into conversations. The JSON
reader underneath is :mod:`data_prep.json_stream`; what a load reports, :mod:`data_prep.load_report`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from draftheads.data_prep.json_stream import BAD_BYTE, BadSyntax, JsonStream, Truncated, eof_caused, open_text
from draftheads.data_prep.load_report import DataError, LoadStats, bump_count

logger = logging.getLogger(__name__)


#: keys that hold the list of turns inside one record, in order of preference
TURN_KEYS = ("conversations", "messages", "conversation")
#: keys that may hold the list of records inside a wrapper object
WRAPPER_KEYS = ("data", "conversations", "records", "items", "examples", "rows",
                "train", "dialogs", "dialogues", "messages")
ROLE_KEYS = ("from", "role")
CONTENT_KEYS = ("value", "content", "text")


def _check_path(path) -> Path:
    p = Path(os.fspath(path)).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"conversation data file not found: {p}")
    if p.is_dir():
        raise IsADirectoryError(f"conversation data path is a directory, expected a .json/.jsonl file: {p}")
    return p


def _skip_region(s: JsonStream, p: Path, stats: LoadStats, on_error: str, index: int, start: int,
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
    bump_count(stats.skipped, reason)
    where = s.abs_loc(start)
    found = s.next_record(start if search_from is None else search_from)
    logger.warning("%s: record %d (%s): %s; skipped %s", p, index, where, what,
                   f"up to the next record at {s.loc()}" if found else "to the end of the file")
    return found


def _iter_array(s: JsonStream, p: Path, stats: LoadStats, on_error: str):
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
        except Truncated:
            if s.next_record(start):  # a complete record follows: the text at start was junk, not a cut
                if not _skip_region(s, p, stats, on_error, index, start, "invalid JSON (an unclosed value)"):
                    return
                index += 1
                continue
            stats.truncated_tail = True
            stats.truncated_at = f"record {index} ({s.abs_loc(start)})"
            return
        except BadSyntax as e:
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
            bump_count(stats.skipped, "bad_encoding")
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
        bump_count(stats.skipped, kind)
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
                if not line.endswith(("\n", "\r")) and eof_caused(text, e):
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
                    x in first for x in ROLE_KEYS + CONTENT_KEYS)):
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
            bump_count(stats.skipped, "bad_encoding")
            logger.warning("%s; record skipped", msg)
            continue
        yield i, rec, f"{stats.format}[{i}]"


def _has_bad_bytes(obj: Any) -> bool:
    """Whether a decoded value holds a byte that was not UTF-8 (a lone surrogate from surrogateescape)."""
    if isinstance(obj, str):
        return BAD_BYTE.search(obj) is not None
    if isinstance(obj, dict):
        return any(_has_bad_bytes(k) or _has_bad_bytes(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_bad_bytes(v) for v in obj)
    return False


def _second_line_is_object(p: Path) -> bool:
    try:
        with open_text(p) as f:
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


def iter_located_records(path, stats: LoadStats, on_error: str = "skip"):
    """Yield ``(index, record, location)``; updates ``stats`` (read, bad_json, truncation)."""
    p = _check_path(path)
    stats.path = str(p)
    yielded = 0

    def produce():
        if p.suffix.lower() in (".jsonl", ".ndjson"):
            yield from _iter_jsonl(p, stats, on_error)
            return
        with open_text(p) as f:
            s = JsonStream(f, _looks_like_record)
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
            except Truncated:
                raise DataError("no_records", f"{p}: the top-level JSON object starting at "
                                f"{s.abs_loc(start)} is truncated (only JSON arrays and JSON Lines "
                                "can be recovered from a cut-off file)") from None
            except BadSyntax as e:
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
    check_on_error(on_error)
    if stats is None:
        stats = LoadStats(source=str(path))
    for index, rec, _loc in iter_located_records(path, stats, on_error):
        yield index, rec


def check_on_error(on_error: str) -> None:
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
