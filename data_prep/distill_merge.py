"""Merge the shard files of a sharded distillation into one file, with one summary.

    python -m draftheads.data_prep.distill_merge runs/x/distilled.jsonl 2

Why: ``torchrun --nproc_per_node N data_prep/distill.py out=X`` writes ``X``'s N shard files (each process its own,
resumable alone); training reads one file. The shards are concatenated in order into ``X`` (atomically: a killed
merge leaves no half file), and ``X.summary.json`` adds up what the shard summaries say (conversations, new tokens;
the slowest shard's seconds), keeping each shard's summary under ``shard_summaries``. The shard files stay: a
later run with the same N resumes them, and a later merge replaces ``X`` again; an ``X`` that no merge wrote (one
process distilled it) is never replaced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftheads.data_prep.shards import shard_path, summary_path
from draftheads.heads import job
from draftheads.heads.checkpoint import atomic_open, atomic_write_text


def _read_summary(out: Path) -> dict:
    """``out``'s summary, {} when it has none (a shard killed before its end, or nothing merged yet)."""
    f = summary_path(out)
    return json.loads(f.read_text()) if f.is_file() else {}


def merge_shards(out: Path, n: int) -> dict:
    """Concatenate ``out``'s n shard files into ``out`` and write its summary; returns the summary."""
    if n < 2:
        raise ValueError(f"a sharded distillation has at least 2 shards, got {n}")
    parts = [shard_path(out, i, n) for i in range(n)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"{out}: shard files missing: {', '.join(missing)} (did every process of the launch finish?)")
    prev = _read_summary(out)
    if out.is_file() and out.stat().st_size and prev.get("shards") != n:
        raise ValueError(f"{out} was not written by a merge of its {n} shards (its summary "
                         f"{'says shard ' + str(prev.get('shard')) if prev else 'is missing'}); merging would replace "
                         f"its records: move it away first")
    records = 0
    with atomic_open(out) as dst:  # streamed: a sharded job is the big one
        for p in parts:
            with open(p, "rb") as src:
                for line in src:
                    dst.write(line)
                    records += 1
    sums = [_read_summary(p) for p in parts]
    new = sum(s.get("new_tokens", 0) for s in sums)
    seconds = max((s.get("seconds", 0.0) for s in sums), default=0.0)
    first = next((s for s in sums if s), {})
    summary = {"out": str(out), "records": records, "shards": n,
               "written": sum(s.get("written", 0) for s in sums), "new_tokens": new, "seconds": seconds,
               "tokens_per_s": round(new / seconds, 1) if seconds else None, "dtype": first.get("dtype"),
               "threads": [s.get("threads") for s in sums],
               "engine_stats": {"decode_attention": (first.get("engine_stats") or {}).get("decode_attention")},
               "shard_summaries": sums}
    atomic_write_text(summary_path(out), json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        raise ValueError(f"usage: python -m draftheads.data_prep.distill_merge OUT N (OUT: the distill job's out=, "
                         f"N: its number of shards), got {args!r}")
    s = merge_shards(Path(args[0]), int(args[1]))
    print(json.dumps({k: v for k, v in s.items() if k != "shard_summaries"}))


if __name__ == "__main__":
    job.cli(main)  # a user error: one line, exit 2
