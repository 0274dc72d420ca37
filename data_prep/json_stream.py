"""A chunked JSON reader: decodes one value at a time out of a text file and knows the byte offset and line of every
position, so a broken or cut-off data file can be read past and each problem reported where it is.

Apart from :mod:`data_prep.records` (which layouts a data file may have, what to skip and how to count it) because
this part knows nothing of records beyond the ``is_record`` test it is given: it finds, decodes and locates JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

_WS = re.compile(r"[ \t\n\r]*")
BAD_BYTE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a non-UTF-8 byte
_NUMBER_PREFIX = re.compile(r"[-+0-9.eE]+")
CHUNK_CHARS = 1 << 20


class Truncated(Exception):
    """Input ended inside a JSON value."""


class BadSyntax(Exception):
    """Invalid JSON that more input would not fix (``err`` says what and where)."""

    def __init__(self, err: json.JSONDecodeError):
        super().__init__(err.msg)
        self.err = err


def eof_caused(buf: str, e: json.JSONDecodeError) -> bool:
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


class JsonStream:
    """Chunked text buffer with ``raw_decode`` and byte/line bookkeeping."""

    _LOOKBACK = 256  # chars kept before pos on refill (for indentation look-back)

    def __init__(self, f, is_record: Callable[[Any], bool], chunk_chars: int | None = None):
        self.f = f
        self.is_record = is_record  # what next_record skips to
        self.chunk = chunk_chars or CHUNK_CHARS
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
            raise Truncated()
        while True:
            try:
                val, end = self._dec.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if not eof_caused(self.buf, e):
                    raise BadSyntax(e) from None
                if self.fill():
                    continue
                raise Truncated() from None
            if end >= len(self.buf) and not isinstance(val, (dict, list, str)) and self.fill():
                continue  # a number may continue in the next chunk
            self.pos = end
            return val

    def bad_byte(self, start: int, end: int) -> int | None:
        """Buffer position of the first undecodable byte in ``buf[start:end]`` (None if there is none)."""
        m = BAD_BYTE.search(self.buf, start, end)
        return m.start() if m else None

    def next_record(self, after_abs: int) -> bool:
        """Move pos to the next ``{`` after absolute offset ``after_abs`` that opens a complete record.

        Whatever the indentation (or none: minified files): a candidate counts when it decodes to an
        object that ``is_record`` accepts (a conversation record), so the turns nested
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
            except (Truncated, BadSyntax):
                val = None
            if self.is_record(val):
                self.pos = cand - self.base
                return True
            nxt = cand + 1


def open_text(path: Path):
    # newline="" keeps "\r\n" untranslated so byte offsets stay exact; an undecodable byte becomes one
    # lone surrogate (U+DC80..U+DCFF) that BAD_BYTE finds, so only the record holding it is lost
    return open(path, "r", encoding="utf-8", errors="surrogateescape", newline="")
