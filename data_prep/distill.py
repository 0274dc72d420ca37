"""Self-distillation: the frozen target rewrites the assistant turns of training conversations.

    python data_prep/distill.py num_conversations=2000 [turns=all] [temperature=0.7]

Heads learn the target's *own* distribution best: a draft trained on the target's answers predicts
what the target will actually say at eval time. Output is a JSONL of ``{"id", "messages", "distill"}``
records that ``data=file data.path=...`` trains on. The job is resumable: records are appended one
line per conversation and flushed per batch; a rerun skips ids already written and repairs a last
line cut off by a killed job. Only training-split conversations are used (held-out prompts never leak), and a
greedy run distills each prompt once (a repeated prompt, e.g. ShareGPT's many "continue" openers, would get the
same answer again).
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

from data_prep.dataset import DataConfig
from data_prep.sources import Conversation, conversation_key, load_conversations, split_conversations
from data_prep.template import ensure_chat_template, prompt_ids
from heads import job
from heads.target import load_target, resolve_device

log = logging.getLogger(__name__)


def prompt_signature(system: list[dict], users: list[str]) -> str:
    """Normalized system prompt + user turns: greedy distillation answers equal signatures identically."""
    return conversation_key(Conversation("", list(system) + [{"role": "user", "content": u} for u in users]))


def read_done(path: Path) -> tuple[set[str], set[str]]:
    """Ids and prompt signatures already distilled; truncates a partially written last line (killed job)."""
    if not path.is_file():
        return set(), set()
    done: set[str] = set()
    sigs: set[str] = set()
    good_bytes = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                done.add(rec["id"])
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


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    for key in ("num_conversations", "batch_size", "max_new_tokens", "max_prompt_tokens"):  # 0: an error, not a no-op
        job.config_int(cfg, key, None, 1)
    target = load_target(cfg.target, device=resolve_device(cfg.device))
    dcfg = DataConfig.from_any(cfg.data)
    ensure_chat_template(target.tokenizer, dcfg.chat_template)
    if cfg.turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {cfg.turns!r}")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done, seen = read_done(out)
    convs, stats = load_conversations(dcfg.source, dcfg.path, None if cfg.num_conversations is None else
                                      int(cfg.num_conversations) * 2 + 100, on_error=dcfg.on_error)
    train, _ = split_conversations(convs, dcfg.heldout_fraction, dcfg.split_seed, by=dcfg.split_by)
    tok = target.tokenizer
    todo: list[tuple[Conversation, list[dict], list[str]]] = []
    skipped_long = skipped_dup = 0
    greedy = float(cfg.temperature) <= 0
    for c in train:
        if cfg.num_conversations is not None and len(todo) + len(done) >= int(cfg.num_conversations):
            break
        system, users = _user_turns(c)
        if not users:
            continue
        if len(prompt_ids(tok, system + [{"role": "user", "content": users[0]}])) > int(cfg.max_prompt_tokens):
            skipped_long += 1
            continue
        if c.id in done:
            continue
        ask = users if cfg.turns == "all" else users[:1]
        sig = prompt_signature(system, ask)
        if greedy and sig in seen:  # the same prompt would get the same answer: a duplicate, not data
            skipped_dup += 1
            continue
        seen.add(sig)
        todo.append((c, system, ask))
    todo.sort(key=lambda x: len(x[2][0]))  # similar prompt lengths per batch: less padding
    log.info("self-distillation: %d done, %d to do, %d skipped (prompt > %d tokens), %d skipped (greedy, "
             "prompt already distilled)", len(done), len(todo), skipped_long, cfg.max_prompt_tokens, skipped_dup)
    # ---- loop
    t0, new_tokens, written = time.perf_counter(), 0, 0
    bar = tqdm(total=len(todo), desc="distill", unit="conv", mininterval=2.0)
    bs = int(cfg.batch_size)
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(todo), bs):
            batch = todo[b:b + bs]
            msgs = [list(system) for _, system, _ in batch]
            finish = ["eos"] * len(batch)
            for turn in range(max(len(u) for _, _, u in batch)):
                active = [i for i, (_, _, u) in enumerate(batch) if turn < len(u)]
                for i in active:
                    msgs[i].append({"role": "user", "content": batch[i][2][turn]})
                prompts = [prompt_ids(tok, msgs[i]) for i in active]
                keep = [i for i, p in zip(active, prompts) if len(p) <= int(cfg.max_prompt_tokens)]
                for i in set(active) - set(keep):
                    msgs[i].pop()  # this turn's prompt grew too long: stop the conversation here
                    batch[i] = (batch[i][0], batch[i][1], batch[i][2][:turn])
                if not keep:
                    continue
                gen = generate_batch(target, [prompt_ids(tok, msgs[i]) for i in keep], cfg,
                                     int(cfg.seed) + b * 1000 + turn)
                for i, (ids, why) in zip(keep, gen):
                    msgs[i].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
                    finish[i] = why if why == "length" else finish[i]
                    new_tokens += len(ids)
            for i, (c, _, _) in enumerate(batch):
                if not any(m["role"] == "assistant" for m in msgs[i]):
                    continue
                rec = {"id": c.id, "messages": msgs[i],
                       "distill": {"target": target.identity.name, "revision": target.identity.revision,
                                   "temperature": float(cfg.temperature), "finish": finish[i]}}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                written += 1
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    elapsed = time.perf_counter() - t0
    summary = {"out": str(out), "written": written, "already_done": len(done), "skipped_long_prompt": skipped_long,
               "skipped_duplicate_prompt": skipped_dup,
               "new_tokens": new_tokens, "seconds": round(elapsed, 1),
               "attn_implementation": str(cfg.target.attn_implementation),
               "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1)}
    log.info("distill done: %s", json.dumps(summary))
    print(json.dumps(summary))
    return summary


@job.main(config_name="distill")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
