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

Speed (the engines: :mod:`data_prep.distill_engines`; shards and resume: :mod:`data_prep.shards`):
``engine=slots`` (:mod:`data_prep.fastgen`) keeps ``batch_size`` conversations in a static KV cache and
refills a row as soon as its conversation ends; ``engine=hf`` is the older ``model.generate`` loop over
left-padded batches (any architecture; ``auto`` uses it where the slot decoder does not apply).
"""

from __future__ import annotations

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
from draftheads.data_prep.distill_engines import run_hf, run_slots
from draftheads.data_prep.fastgen import SlotDecoder, supports
from draftheads.data_prep.prompt_kinds import kind_counts
from draftheads.data_prep.shards import (check_shard_out, parse_shard, prompt_signature, read_done, shard_of,
                                         shard_path, summary_path)
from draftheads.data_prep.sources import Conversation, load_conversations
from draftheads.data_prep.splits import split_conversations
from draftheads.data_prep.template import ensure_chat_template, prompt_ids
from draftheads.heads import job, outputs
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.target import load_target, resolve_device

log = logging.getLogger(__name__)


def _user_turns(c: Conversation) -> tuple[list[dict], list[str]]:
    system = [m for m in c.messages[:1] if m["role"] == "system"]
    return system, [m["content"] for m in c.messages if m["role"] == "user"]


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
    own = shard_path(Path(cfg.out), shard, n_shards)
    if own.is_dir():
        raise ValueError(f"out={own} is a folder; distill writes a JSONL file: give a file path, "
                         f"e.g. out={own}/distilled.jsonl")
    outputs.claim(own, "distill")  # one writer per file: a second distill into it gets one line, before any load
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
