"""Self-distillation: the frozen target rewrites the assistant turns of training conversations.

    python data_prep/distill.py [num_conversations=2000] [turns=first] [temperature=0.7 seed=1]

Heads learn the target's *own* distribution best: a draft trained on the target's answers predicts
what the target will actually say at eval time. Output is a JSONL of ``{"id", "messages", "distill"}``
records that ``data=file data.path=...`` trains on. ``turns=all`` (the default) answers every user turn of a
conversation on the target's own earlier answers (as MT-bench's second turns are asked); run on a file made with
``turns=first``, it keeps those answers and asks the later turns after them, appending each extended record (the
longer record supersedes the shorter one wherever the file is read). ``temperature > 0``
samples, each (conversation, turn) from its own seeded generator, so a rerun reproduces it whatever the batching.

The job is resumable: a record is appended per finished conversation and flushed/fsynced every few seconds; a
rerun skips ids already written and repairs a last line cut off by a killed job. Only training-split
conversations are used (held-out prompts never leak), a prompt that appears in an eval question file
(``eval_questions``, MT-bench by default) is dropped, and a greedy run distills each prompt once (a repeated
prompt, e.g. ShareGPT's many "continue" openers, would get the same answer again).

Speed: ``engine=slots`` (:mod:`data_prep.fastgen`) keeps ``batch_size`` conversations in a static KV cache and
refills a row as soon as its conversation ends; ``engine=hf`` is the older ``model.generate`` loop over
left-padded batches (any architecture; ``auto`` uses it where the slot decoder does not apply).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from draftheads.data_prep.dataset import DataConfig
from draftheads.data_prep.fastgen import SlotDecoder, common_prefix, describe, sample_next, supports
from draftheads.data_prep.prompt_kinds import kind_counts
from draftheads.data_prep.sources import Conversation, conversation_key, load_conversations, split_conversations
from draftheads.data_prep.template import ensure_chat_template, prompt_ids
from draftheads.heads import job
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.target import load_target, resolve_device

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


def _user_turns(c: Conversation) -> tuple[list[dict], list[str]]:
    system = [m for m in c.messages[:1] if m["role"] == "system"]
    return system, [m["content"] for m in c.messages if m["role"] == "user"]


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



# ---- never train on eval prompts

def _norm(text: str) -> str:
    return prompt_signature([], [text])


def eval_prompts(paths: list[str]) -> tuple[set[str], list[str]]:
    """Normalized turns of the eval question files (MT-bench format: ``{"turns": [...]}`` per line) that exist;
    returns (prompts, files read). A missing file is skipped with a warning (a fresh clone has none)."""
    prompts: set[str] = set()
    read: list[str] = []
    for p in paths or []:
        path = Path(str(p))
        if not path.is_file():
            log.warning("eval question file %s not found: its prompts cannot be excluded", path)
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    turns = json.loads(line)["turns"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"eval_questions file {path}, line {n}: expected a JSON object with 'turns' "
                                     f"(MT-bench format)") from None
                prompts.update(_norm(t) for t in turns if isinstance(t, str))
        read.append(str(path))
    return prompts, read


def refuse_eval_source(data_path: str | None, eval_files: list[str]) -> None:
    """The prompt source must not be an eval question file: one listed in ``eval_questions``, or any file in
    MT-bench's question format (``question_id`` + ``turns`` records)."""
    if not data_path:
        return
    p = Path(str(data_path))
    if any(Path(e).is_file() and p.is_file() and p.resolve() == Path(e).resolve() for e in eval_files):
        raise ValueError(f"data.path={data_path} is an eval question file (listed in eval_questions): distilling "
                         f"it would train on the eval; use a training conversations file")
    if p.is_file():
        with open(p, encoding="utf-8", errors="replace") as f:
            first = f.readline()
        try:
            rec = json.loads(first)
        except json.JSONDecodeError:
            return
        if isinstance(rec, dict) and "question_id" in rec and "turns" in rec:
            raise ValueError(f"data.path={data_path} holds eval questions (MT-bench format: question_id/turns on "
                             f"line 1); distillation reads training conversations only")


# ---- generation engines: each calls emit(conversation, messages, finish reasons per answered turn)

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


def _extension(rec: dict, system: list[dict], users: list[str], temperature: float) -> tuple[list[dict], list[str]]:
    """What ``turns=all`` asks after a distilled record: (its messages, the conversation's user turns it has not
    answered). No turns to ask when it answered them all; None for the messages when it cannot be extended (another
    temperature, another system prompt, or first turns that differ from the conversation's)."""
    msgs = rec.get("messages") or []
    k = sum(m.get("role") == "user" for m in msgs)
    if k >= len(users):
        return msgs, []
    turns = msgs[len(system):]
    same = (k > 0 and float((rec.get("distill") or {}).get("temperature", -1.0)) == temperature
            and msgs[:len(system)] == system and [m.get("role") for m in turns] == ["user", "assistant"] * k
            and [m["content"] for m in turns[::2]] == users[:k])
    return (msgs if same else None), users[k:]


def select_prompts(cfg: DictConfig, tok, done: dict[str, dict], seen: set[str]) -> tuple[list, dict[str, Any]]:
    """Training-split conversations still to distill, as (conversation, messages so far, user turns to answer),
    sorted by next prompt length within blocks of ``sort_block`` (similar lengths share a batch); plus counts of
    what was skipped and why. With ``turns=all``, a record in ``done`` that answered only the first turns of its
    conversation (a ``turns=first`` file) is extended: its answers stay, the later turns are asked after them."""
    dcfg = DataConfig.from_any(cfg.data)
    eval_files = list(cfg.get("eval_questions") or [])
    refuse_eval_source(dcfg.path if dcfg.source == "file" else None, eval_files)
    banned, eval_read = eval_prompts(eval_files)
    n_max = None if cfg.num_conversations is None else int(cfg.num_conversations)
    convs, _ = load_conversations(dcfg.source, dcfg.path, None if n_max is None else n_max * 2 + 100,
                                  on_error=dcfg.on_error)
    shard, n_shards = parse_shard(cfg.get("shard", "auto"))
    n_max = None if n_max is None else -(-n_max // n_shards)  # the limit is shared out among the shards
    train, held = split_conversations(convs, dcfg.heldout_fraction, dcfg.split_seed, by=dcfg.split_by)
    todo: list[tuple[Conversation, list[dict], list[str]]] = []
    skipped = {"long_prompt": 0, "duplicate_prompt": 0, "eval_prompt": 0, "long_history": 0,
               "not_extendable": 0}
    n_extend = other_shards = 0
    greedy = float(cfg.temperature) <= 0
    lens: dict[str, int] = {}
    for c in train:
        full = n_max is not None and len(todo) - n_extend + len(done) >= n_max  # no new conversation; extensions go on
        if full and (cfg.turns != "all" or c.id not in done):
            continue
        system, users = _user_turns(c)
        if not users:
            continue
        if n_shards > 1 and shard_of(system, users, n_shards) != shard:
            other_shards += 1
            continue
        if any(_norm(u) in banned for u in users):
            skipped["eval_prompt"] += 1
            continue
        n_first = len(prompt_ids(tok, system + [{"role": "user", "content": users[0]}]))
        if n_first > int(cfg.max_prompt_tokens):
            skipped["long_prompt"] += 1
            continue
        if c.id in done:
            if cfg.turns != "all":
                continue
            prefix, ask = _extension(done[c.id], system, users, float(cfg.temperature))
            if not ask:  # every turn answered already
                continue
            if prefix is None:
                skipped["not_extendable"] += 1  # another temperature, or turns that differ: counted, kept as is
                continue
            n_next = len(prompt_ids(tok, prefix + [{"role": "user", "content": ask[0]}]))
            if n_next > int(cfg.max_prompt_tokens):  # the history has grown too long to ask the next turn
                skipped["long_history"] += 1
                continue
            seen.add(prompt_signature(system, users))
            lens[c.id] = n_next
            todo.append((c, prefix, ask))
            n_extend += 1
            continue
        ask = users if cfg.turns == "all" else users[:1]
        sig = prompt_signature(system, ask)
        if greedy and sig in seen:  # the same prompt would get the same answer: a duplicate, not data
            skipped["duplicate_prompt"] += 1
            continue
        seen.add(sig)
        lens[c.id] = n_first
        todo.append((c, system, ask))
    block = cfg.get("sort_block")
    block = len(todo) or 1 if block is None else int(block)
    if block < 1:
        raise ValueError(f"sort_block must be a whole number >= 1 or null, got {cfg.get('sort_block')!r}")
    # similar prompt lengths run together (less ragged cache), but only within blocks in the split's order: a job
    # cut short by max_minutes has covered every prompt length, not just the shortest prompts
    todo = [x for b in range(0, len(todo), block) for x in sorted(todo[b:b + block], key=lambda x: lens[x[0].id])]
    info = {"source_conversations": len(convs), "train_split": len(train), "heldout_split_untouched": len(held),
            "eval_question_files": eval_read, "eval_prompts_excluded": len(banned), "skipped": skipped,
            "extending": n_extend, "shard": f"{shard}/{n_shards}", "left_to_other_shards": other_shards}
    return todo, info


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    for key in ("num_conversations", "batch_size", "max_new_tokens", "max_prompt_tokens"):  # 0: an error, not a no-op
        job.config_int(cfg, key, None, 1)
    minutes = cfg.get("max_minutes")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0):
        raise ValueError(f"max_minutes must be a positive number of minutes or null, got {minutes!r}")
    if cfg.turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {cfg.turns!r}")
    if cfg.engine not in ("auto", "slots", "hf"):
        raise ValueError(f"engine must be auto, slots or hf, got {cfg.engine!r}")
    if cfg.get("refill", "merged") not in ("merged", "separate"):
        raise ValueError(f"refill must be merged or separate, got {cfg.refill!r}")
    SlotDecoder.check_attention(cfg.get("decode_attention", "auto"))
    shard, n_shards = parse_shard(cfg.get("shard", "auto"))
    check_shard_out(Path(cfg.out), n_shards)
    if str(cfg.device) == "auto" and "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per launched process
    target = load_target(cfg.target, device=resolve_device(cfg.device))
    dcfg = DataConfig.from_any(cfg.data)
    ensure_chat_template(target.tokenizer, dcfg.chat_template)
    engine = cfg.engine if cfg.engine != "auto" else ("slots" if supports(target.model) else "hf")
    if engine == "slots" and not supports(target.model):
        raise ValueError(f"engine=slots supports Llama/Qwen2/Qwen3-style targets without sliding windows; "
                         f"{target.config.model_type!r} needs engine=hf")
    out = shard_path(Path(cfg.out), shard, n_shards)
    out.parent.mkdir(parents=True, exist_ok=True)
    done, seen = read_done(out)
    todo, info = select_prompts(cfg, target.tokenizer, done, seen)
    log.info("self-distillation (%s engine, %s turns, T=%s): %d done, %d to do; %s", engine, cfg.turns,
             cfg.temperature, len(done), len(todo), json.dumps(info))
    # ---- loop: a record per finished conversation, flushed and fsynced every few seconds
    t0 = time.perf_counter()
    written, turns_answered, extended, first_users = 0, 0, 0, []
    bar = tqdm(total=len(todo), desc="distill", unit="conv", mininterval=2.0)
    with open(out, "a", encoding="utf-8") as f:
        last_sync = [time.perf_counter()]

        def emit(c: Conversation, msgs: list[dict], finish: list[str]) -> None:
            nonlocal written, turns_answered, extended
            turns_answered += len(finish)
            if c.id in done:  # an extended record: appended whole, it supersedes the shorter one when read
                finish = list((done[c.id].get("distill") or {}).get("turn_finish") or []) + finish
                extended += 1
            rec = {"id": c.id, "messages": msgs,
                   "distill": {"target": target.identity.name, "revision": target.identity.revision,
                               "temperature": float(cfg.temperature), "seed": int(cfg.seed),
                               "finish": "length" if "length" in finish else "eos", "turn_finish": finish}}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            written += 1
            first_users.append(next(m["content"] for m in msgs if m["role"] == "user"))
            bar.update(1)
            if time.perf_counter() - last_sync[0] > 5.0:
                f.flush()
                os.fsync(f.fileno())
                last_sync[0] = time.perf_counter()

        deadline = None if minutes is None else time.monotonic() + 60.0 * float(minutes)
        stats = ((run_slots if engine == "slots" else run_hf)(target, todo, cfg, emit, deadline) if todo
                 else {"new_tokens": 0})
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    elapsed = time.perf_counter() - t0
    kinds = kind_counts(first_users)
    summary = {"out": str(out), "written": written, "already_done": len(done), "extended": extended,
               "turns_answered": turns_answered,
               "left_to_do": len(todo) - written, "stopped_at_max_minutes": minutes is not None and written < len(todo),
               "skipped_long_prompt": info["skipped"]["long_prompt"],
               "skipped_duplicate_prompt": info["skipped"]["duplicate_prompt"],
               "skipped_eval_prompt": info["skipped"]["eval_prompt"],
               "skipped_long_history": info["skipped"]["long_history"],
               "skipped_not_extendable": info["skipped"]["not_extendable"], "engine": engine, "turns": cfg.turns,
               "new_tokens": stats["new_tokens"], "seconds": round(elapsed, 1),
               "attn_implementation": str(cfg.target.attn_implementation),
               "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
               "tokens_per_s": round(stats["new_tokens"] / max(elapsed, 1e-9), 1),
               "prompt_kinds": kinds, "engine_stats": {k: v for k, v in stats.items() if k != "new_tokens"},
               **{k: v for k, v in info.items() if k != "skipped"}}
    log.info("prompt kinds of the %d conversations written (regex classifier of the first user message): %s",
             written, ", ".join(f"{k} {v}" for k, v in kinds.items()))
    log.info("distill done: %s", json.dumps(summary))
    atomic_write_text(summary_path(out), json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return summary


@job.main(config_name="distill")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
