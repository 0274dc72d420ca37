"""Distillation's output bookkeeping: which shard a conversation belongs to, the shard and summary file names, and
what a rerun finds already written (the records to skip, a cut-off last line repaired).

Why a module of its own: the job (``distill.py``), the shard merge (``distill_merge.py``) and the benchmarks read the
same names and the same resume rule; the generation loop does not need any of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from draftheads.data_prep.sources import Conversation
from draftheads.data_prep.splits import conversation_key
from draftheads.heads import job

log = logging.getLogger(__name__)


def prompt_signature(system: list[dict], users: list[str]) -> str:
    """Normalized system prompt + user turns: greedy distillation answers equal signatures identically."""
    return conversation_key(Conversation("", list(system) + [{"role": "user", "content": u} for u in users]))


def parse_shard(spec: Any, env: dict[str, str] | None = None) -> tuple[int, int]:
    """``shard`` as (index, count): ``i/n``, or ``auto`` = the ``RANK``/``WORLD_SIZE`` a torchrun or accelerate
    launch sets (one process per GPU), else ``0/1``."""
    text = str(spec).strip()
    try:
        i, n = job.launch_rank(env) if text == "auto" else (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"shard must be auto or i/n with 0 <= i < n (e.g. 0/4), got {spec!r}")
    return i, n


def shard_of(system: list[dict], users: list[str], n: int) -> int:
    """Which of ``n`` shards a conversation belongs to: a hash of its system prompt and first user turn, so
    prompts that greedy distillation would answer alike (and a conversation's later turns) stay in one shard."""
    digest = hashlib.sha256(prompt_signature(system, users[:1]).encode()).digest()
    return int.from_bytes(digest[:8], "big") % n


def shard_path(out: Path, i: int, n: int) -> Path:
    """Shard i of n writes ``<name>.shard<i>of<n><suffix>`` beside ``out`` (``out`` itself when n == 1)."""
    return out if n == 1 else out.with_name(f"{out.stem}.shard{i}of{n}{out.suffix}")


def summary_path(out: Path) -> Path:
    """The job's summary beside its output: ``<out>.summary.json`` (the merge reads and writes the same names)."""
    return Path(str(out) + ".summary.json")


def check_shard_out(out: Path, n: int) -> None:
    """Refuse sharding over an ``out`` that one process wrote: the shards would distil its conversations again
    (they resume only their own files) and merging them would replace it, losing its records."""
    if n == 1 or not out.is_file() or out.stat().st_size == 0:
        return
    if any(shard_path(out, i, n).exists() for i in range(n)):
        return  # a merge of these shards: they resume
    raise ValueError(f"out={out} holds records that one process distilled; shard=i/{n} writes "
                     f"{shard_path(out, 0, n).name} etc. beside it, would distil those conversations again, and merging "
                     f"them would replace {out.name}: distill it with one process (shard=0/1) or shard into another out")


def read_done(path: Path) -> tuple[dict[str, dict], set[str]]:
    """The records already distilled, by id (a later record of an id supersedes an earlier one), and their prompt
    signatures; truncates a partially written last line (killed job)."""
    if not path.is_file():
        return {}, set()
    done: dict[str, dict] = {}
    sigs: set[str] = set()
    good_bytes = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                done[rec["id"]] = rec
                msgs = rec.get("messages") or []
                sigs.add(prompt_signature([m for m in msgs[:1] if m.get("role") == "system"],
                                          [m.get("content", "") for m in msgs if m.get("role") == "user"]))
                good_bytes += len(line)
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError, AttributeError, TypeError):
                break  # only the last line can be partial: everything before it was flushed whole
    if good_bytes != path.stat().st_size:
        log.warning("%s: dropping a partially written last record (%d bytes)", path,
                    path.stat().st_size - good_bytes)
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return done, sigs
