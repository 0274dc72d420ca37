"""What loading a data file reports: ``DataError`` (a reason code per kind of bad record or file) and ``LoadStats``
(records read, kept, skipped by reason, repaired, and where a cut-off file was cut).

Apart from the readers (:mod:`data_prep.records`, :mod:`data_prep.sources`) because both raise and count with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    superseded: int = 0           # conversations replaced by a longer one with the same id that extends them
    stopped_early: bool = False   # stopped because max_conversations was reached
    seconds: float = 0.0
    first_skip: dict[str, str] = field(default_factory=dict)  # reason -> the first skipped record's message

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        def fmt(d: dict[str, int]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))

        parts = [f"{self.source}: read {self.read}, kept {self.kept}, skipped {self.n_skipped}"]
        if self.skipped:
            parts[0] += f" ({fmt(self.skipped)})"
        for reason, msg in sorted(self.first_skip.items()):  # what was wrong and what is allowed, once per reason
            parts.append(f"first {reason}: {msg}")
        if self.fixed:
            parts.append(f"fixed turns: {fmt(self.fixed)}")
        if self.duplicate_ids:
            parts.append(f"duplicate ids: {self.duplicate_ids}")
        if self.superseded:
            parts.append(f"superseded by their extension: {self.superseded}")
        if self.truncated_tail:
            parts.append(f"file truncated (partial record at {self.truncated_at or 'end'} dropped)")
        if self.stopped_early:
            parts.append("stopped at max_conversations")
        parts.append(f"{self.format or '?'}, {self.seconds:.2f}s")
        return "; ".join(parts)


def bump_count(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n
