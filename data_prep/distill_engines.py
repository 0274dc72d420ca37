"""Distillation's generation engines: each answers the user turns of a list of conversations and calls
``emit(conversation, messages, finish reasons per answered turn)`` as each conversation finishes.

``run_slots`` keeps ``batch_size`` conversations in a static KV cache (:mod:`data_prep.fastgen`) and refills a row as
soon as its conversation ends; ``run_hf`` is the older ``model.generate`` loop over left-padded batches (any
architecture). Apart from the job (``distill.py``: which prompts, where the records go) so the benchmarks run the
very same loops.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from draftheads.data_prep.fastgen import SlotDecoder, common_prefix, describe, sample_next
from draftheads.data_prep.sources import Conversation
from draftheads.data_prep.template import prompt_ids


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], cfg: Any, generator_seed: int) -> list[tuple[list[int], str]]:
    """Left-padded batched generation; returns (new tokens without EOS/padding, finish reason) per prompt."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    att = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        att[i, T - len(p):] = 1
    sample = float(cfg.temperature) > 0
    torch.manual_seed(generator_seed)
    out = target.model.generate(
        input_ids=ids.to(target.device), attention_mask=att.to(target.device), max_new_tokens=int(cfg.max_new_tokens),
        do_sample=sample, temperature=float(cfg.temperature) if sample else None,
        top_p=float(cfg.top_p) if sample else None, top_k=int(cfg.top_k) if sample and cfg.top_k else None,
        pad_token_id=pad, eos_token_id=tok.eos_token_id, repetition_penalty=None)
    res = []
    for row in out[:, T:].tolist():
        if tok.eos_token_id in row:
            res.append((row[: row.index(tok.eos_token_id)], "eos"))
        else:
            res.append((row, "length"))
    return res


def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    """Seed of one (conversation, turn)'s sampler: reproducible and independent of batch order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{conv_id}:{turn}".encode("utf-8", "surrogatepass")).digest()[:8],
                          "little") & (2**63 - 1)


class _Row:
    """One conversation in flight in a slot."""

    def __init__(self, conv: Conversation, history: list[dict], users: list[str]):
        self.conv, self.users = conv, users
        self.msgs: list[dict] = list(history)  # system prompt, and the earlier turns of a record being extended
        self.turn = 0  # index into users
        self.turn0 = sum(m["role"] == "assistant" for m in history)  # turns answered before this job
        self.cached: list[int] = []  # token ids in this row's KV cache
        self.gen: list[int] = []  # this turn's answer so far
        self.finish: list[str] = []
        self.rng: torch.Generator | None = None


def until(items: Any, deadline: float | None, clock: Any = time.monotonic):
    """``items`` in order, stopping (between items) once ``clock()`` passes ``deadline``."""
    for x in items:
        if deadline is not None and clock() > deadline:
            return
        yield x


def run_slots(target, todo: list, cfg: Any, emit, deadline: float | None = None) -> dict[str, Any]:
    """Continuous batching over a static KV cache (see :mod:`data_prep.fastgen`). Rows whose turn ended in a
    step are refilled together: with ``refill=merged`` their next prompts are prefilled inside the next decode
    step's forward (the rows wait that one step), with ``refill=separate`` in batched prefills of their own."""
    tok = target.tokenizer
    eos, max_new, max_prompt = tok.eos_token_id, int(cfg.max_new_tokens), int(cfg.max_prompt_tokens)
    temp, top_k, top_p = float(cfg.temperature), int(cfg.top_k or 0), float(cfg.top_p)
    slots = max(1, min(int(cfg.batch_size), len(todo)))
    dec = SlotDecoder(target.model, slots, max_prompt + max_new, str(cfg.get("decode_attention", "auto")))
    rows: list[_Row | None] = [None] * slots
    next_tok = torch.zeros(slots, dtype=torch.long, device=dec.device)
    queue = until(todo, deadline)  # conversations in flight at the deadline still finish
    stats = {"prefill_tokens": 0, "reused_tokens": 0, "prefill_calls": 0, "prefills_in_decode_steps": 0,
             "decode_steps": 0, "new_tokens": 0,
             "prefill_s": 0.0, "decode_s": 0.0, "sample_s": 0.0}  # where the time goes (the rest: templating)

    def next_prompt(r: _Row) -> list[int] | None:
        """The prompt of row r's next turn (the user turn appended), or None when the conversation is over."""
        while r.turn < len(r.users):
            r.msgs.append({"role": "user", "content": r.users[r.turn]})
            ids = prompt_ids(tok, r.msgs)
            if len(ids) <= max_prompt:
                return ids
            r.msgs.pop()  # this turn's prompt grew too long: stop the conversation here
            break
        return None

    def feed(i: int, r: _Row, t: int) -> bool:
        """Take sampled token t for row i; True while the turn goes on (t is fed at the next step)."""
        if t != eos:
            r.gen.append(t)
            stats["new_tokens"] += 1
        if t == eos or len(r.gen) >= max_new:
            r.finish.append("eos" if t == eos else "length")
            return False
        next_tok[i] = t
        r.cached.append(t)
        return True

    def advance(r: _Row | None) -> tuple[_Row | None, list[int] | None]:
        """Row r's next prompt, going on to the next conversation when r's is over (emitting it):
        (row, prompt ids), or (None, None) when no conversation is left to start."""
        while True:
            if r is not None and len(r.finish) > r.turn:  # a turn just ended: its answer joins the history
                r.msgs.append({"role": "assistant", "content": tok.decode(r.gen, skip_special_tokens=True)})
                r.turn += 1
            ids = None if r is None else next_prompt(r)
            if ids is not None:
                return r, ids
            if r is not None and r.turn > 0:  # at least one answer (a too-long first prompt gives none)
                emit(r.conv, r.msgs, r.finish)
            job = next(queue, None)
            if job is None:
                return None, None
            r = _Row(*job)

    def start(i: int, ids: list[int], keep: int, lg: torch.Tensor) -> bool:
        """Row i's prompt ids were just prefilled (logits lg [V] follow them): begin its answer. False when the
        first token already ends it (the row is settled again)."""
        r = rows[i]
        stats["reused_tokens"] += keep
        r.cached, r.gen = list(ids), []
        if temp > 0:
            r.rng = torch.Generator(device=dec.device).manual_seed(
                turn_seed(int(cfg.seed), r.conv.id, r.turn0 + r.turn))
        return feed(i, r, int(sample_next(lg[None], temp, top_k, top_p, [r.rng])[0]))

    def settle(free: list[int]) -> tuple[list[tuple[int, list[int], int]], list[int]]:
        """Each free row's next turn or the next conversation: (prefill jobs (row, ids, keep), rows left empty)."""
        jobs, empty = [], []
        for i in free:
            rows[i], ids = advance(rows[i])
            if ids is None:
                empty.append(i)
            else:  # earlier turns of the conversation stay cached
                jobs.append((i, ids, min(common_prefix(rows[i].cached, ids), len(ids) - 1)))
        return jobs, empty

    def refill(free: list[int]) -> list[int]:
        """Settle the free rows, prefilling all their prompts together (forwards of their own). Returns the rows
        left empty (no conversation left to start)."""
        empty = []
        while free:
            jobs, gone = settle(free)
            empty += gone
            free = []
            for chunk in _token_chunks(jobs, dec.PREFILL_TOKENS):
                t = time.perf_counter()
                logits = dec.prefill_many(chunk)  # [n, V]
                stats["prefill_s"] += time.perf_counter() - t
                stats["prefill_calls"] += 1
                stats["prefill_tokens"] += sum(len(ids) - keep for _, ids, keep in chunk)
                free += [i for (i, ids, keep), lg in zip(chunk, logits) if not start(i, ids, keep, lg)]
        return empty

    def compact(empty: list[int], width: int) -> int:
        """Retire the empty rows: the last live row moves down into each (high to low), so rows stay dense."""
        for i in sorted(empty, reverse=True):
            width -= 1
            if i != width:
                dec.move(width, i)
                rows[i], rows[width] = rows[width], None
                next_tok[i] = next_tok[width]
                if width in pending:
                    pending[i] = pending.pop(width)
        return width

    merged = str(cfg.get("refill", "merged")) == "merged"
    pending: dict[int, tuple[list[int], int]] = {}  # merged refills: row -> (prompt ids, kept prefix) to prefill
    t_start = time.perf_counter()
    width = compact(refill(list(range(slots))), slots)
    while width > 0:
        if width < slots and "drained_s" not in stats:  # the queue ran dry: from here on rows only retire
            stats["drained_s"] = time.perf_counter() - t_start
            stats["new_tokens_before_drain"] = stats["new_tokens"]
        jobs = [(i, ids, keep) for i, (ids, keep) in sorted(pending.items())]  # every pending refill rides this step
        t = time.perf_counter()
        logits, first = dec.step(next_tok[:width], jobs)  # [w, V], [n, V]
        t1 = time.perf_counter()
        # a row being prefilled decodes nothing
        live = [i for i in range(width) if i not in pending] if pending else range(width)
        toks = sample_next(logits if len(live) == width else logits[live], temp, top_k, top_p,
                           [rows[i].rng for i in live]).tolist() if live else []
        stats["decode_s"] += t1 - t
        stats["sample_s"] += time.perf_counter() - t1
        stats["decode_steps"] += 1
        done = [i for i, tk in zip(live, toks) if not feed(i, rows[i], tk)]
        pending.clear()
        for (i, ids, keep), lg in zip(jobs, first):
            stats["prefill_tokens"] += len(ids) - keep
            stats["prefills_in_decode_steps"] += 1
            if not start(i, ids, keep, lg):
                done.append(i)
        if not done:
            continue
        if merged:
            jobs, empty = settle(done)
            pending.update((i, (ids, keep)) for i, ids, keep in jobs)
        else:
            empty = refill(done)
        width = compact(empty, width)
    stats.update(describe(dec))
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in stats.items()}


def _token_chunks(jobs: list[tuple[int, list[int], int]], tokens: int):
    """``jobs`` (row, ids, keep) in runs of about ``tokens`` new tokens each (one batched prefill per run)."""
    chunk, n = [], 0
    for j in jobs:
        chunk.append(j)
        n += len(j[1]) - j[2]
        if n >= tokens:
            yield chunk
            chunk, n = [], 0
    if chunk:
        yield chunk


def run_hf(target, todo: list, cfg: Any, emit, deadline: float | None = None) -> dict[str, Any]:
    """``model.generate`` on left-padded batches, turn by turn (any architecture; the pre-slot engine)."""
    tok = target.tokenizer
    bs, stats = int(cfg.batch_size), {"new_tokens": 0}
    for b in until(range(0, len(todo), bs), deadline):
        batch = [(c, list(system), users) for c, system, users in todo[b:b + bs]]
        finish: list[list[str]] = [[] for _ in batch]
        for turn in range(max(len(u) for _, _, u in batch)):
            keep = []
            for i, (_, msgs, users) in enumerate(batch):
                if turn < len(users) and len(finish[i]) == turn:  # still going
                    msgs.append({"role": "user", "content": users[turn]})
                    if len(prompt_ids(tok, msgs)) <= int(cfg.max_prompt_tokens):
                        keep.append(i)
                    else:
                        msgs.pop()  # this turn's prompt grew too long: stop the conversation here
            if not keep:
                break
            gen = generate_batch(target, [prompt_ids(tok, batch[i][1]) for i in keep], cfg,
                                 int(cfg.seed) + b * 1000 + turn)
            for i, (ids, why) in zip(keep, gen):
                batch[i][1].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
                finish[i].append(why)
                stats["new_tokens"] += len(ids)
        for (c, msgs, _), fin in zip(batch, finish):
            if fin:
                emit(c, msgs, fin)
    return stats
