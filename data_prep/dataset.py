"""From conversations to a cached, tokenized Arrow dataset (train + held-out), and batch collation.

The cache key covers everything that changes the result (source file identity, the tokenizer and
its chat template, max length, truncation, packing, split), so a rerun with the same settings
loads in seconds and a changed setting never silently reuses stale tokens. The cache directory is
written to a temp name and renamed, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from draftheads.data_prep.sources import Conversation, load_conversations, sharegpt_path
from draftheads.data_prep.splits import SPLIT_BY, dedupe_conversations, prompt_key, split_conversations
from draftheads.data_prep.template import TemplateError, ensure_chat_template, tokenize_conversation
from draftheads.heads.checkpoint import atomic_dir
from draftheads.heads.schema import DataConfig  # noqa: F401  (the data group's schema; imported from here by callers)
from draftheads.heads.target_source import cache_root

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # bump when tokenization/masking/splitting changes meaning (2: held-out rows in hash order)


@dataclass
class PreparedData:
    train: Any  # datasets.Dataset with input_ids, loss_mask (+ position_ids, doc_ids when packed)
    heldout: Any  # same columns, held-out conversations
    heldout_questions: Path  # MT-bench-format JSONL of held-out user turns (the default eval set)
    stats: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def _source_identity(cfg: DataConfig) -> dict[str, Any]:
    path = Path(sharegpt_path() if cfg.source == "sharegpt" else (cfg.path or ""))
    if cfg.source not in ("sharegpt", "file"):
        raise ValueError(f"data.source must be 'sharegpt' or 'file', got {cfg.source!r}")
    if cfg.source == "file" and not cfg.path:
        raise ValueError("data.source=file needs data.path (a JSON or JSONL file)")
    if path.is_dir():
        raise IsADirectoryError(f"data.path={path} is a directory; expected a JSON or JSONL conversations file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    return file_identity(path)


def file_identity(path: Path) -> dict[str, Any]:
    """What a cache keyed on a file's contents checks cheaply: its resolved path, size and mtime."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


def cache_key(cfg: DataConfig, tokenizer: Any) -> str:
    relevant = {k: v for k, v in asdict(cfg).items() if k not in ("name", "cache_dir")}
    blob = json.dumps({"v": CACHE_VERSION, "cfg": relevant, "src": _source_identity(cfg),
                       "tok": tokenizer_fingerprint(tokenizer)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _first_turn(c: Conversation) -> Conversation:
    msgs, seen_user = [], False
    for m in c.messages:
        msgs.append(m)
        if m["role"] == "user":
            seen_user = True
        if m["role"] == "assistant" and seen_user:
            break
    return Conversation(c.id, msgs)


def tokenize_all(convs: Sequence[Conversation], tokenizer: Any, cfg: DataConfig, desc: str,
                 ) -> tuple[dict[str, list], dict[str, int]]:
    """Tokenize conversations; returns columns and counted drop reasons."""
    cols: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    counts: dict[str, int] = {"examples": 0, "truncated": 0, "tokens": 0, "assistant_tokens": 0}
    for c in tqdm(convs, desc=desc, unit="conv", mininterval=2.0):
        try:
            tk = tokenize_conversation(tokenizer, c.messages, cfg.max_length if cfg.truncation == "truncate" else None)
        except TemplateError as e:
            if e.reason in ("no_chat_template", "template_not_prefix_stable", "slow_tokenizer"):
                raise
            counts[f"dropped:{e.reason}"] = counts.get(f"dropped:{e.reason}", 0) + 1
            continue
        if cfg.truncation == "drop" and len(tk.input_ids) > cfg.max_length:
            counts["dropped:over_max_length"] = counts.get("dropped:over_max_length", 0) + 1
            continue
        counts["truncated"] += int(tk.truncated)
        counts["examples"] += 1
        counts["tokens"] += len(tk.input_ids)
        counts["assistant_tokens"] += sum(tk.loss_mask)
        cols["id"].append(c.id)
        cols["input_ids"].append(tk.input_ids)
        cols["loss_mask"].append(tk.loss_mask)
    return cols, counts


def pack(cols: dict[str, list], max_length: int) -> dict[str, list]:
    """Concatenate examples into blocks of at most max_length tokens (no example is split)."""
    out: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": [], "position_ids": [], "doc_ids": []}
    cur: dict[str, list] = {k: [] for k in out}

    def flush():
        if cur["input_ids"]:
            for k in out:
                out[k].append(cur[k] if k != "id" else ",".join(cur["id"]))
            for k in cur:
                cur[k] = []

    for i, (cid, ids, m) in enumerate(zip(cols["id"], cols["input_ids"], cols["loss_mask"])):
        if len(cur["input_ids"]) + len(ids) > max_length:
            flush()
        doc = (cur["doc_ids"][-1] + 1) if cur["doc_ids"] else 0
        cur["id"].append(cid)
        cur["input_ids"] += ids
        cur["loss_mask"] += m
        cur["position_ids"] += list(range(len(ids)))
        cur["doc_ids"] += [doc] * len(ids)
    flush()
    return out


HELDOUT_CATEGORY = "sharegpt-heldout"
LEAKED_CATEGORY = "sharegpt-heldout-opener-in-train"  # only possible with split_by=id


def _questions_jsonl(convs: Sequence[Conversation], opener_in_train: Sequence[bool]) -> str:
    """Held-out user turns as MT-bench-format questions; a question whose opener also opens a training
    conversation gets its own category, so every report shows its τ apart from the clean ones."""
    assert len(opener_in_train) == len(convs)
    lines = []
    for c, leaked in zip(convs, opener_in_train):
        turns = [m["content"] for m in c.messages if m["role"] == "user"]
        system = next((m["content"] for m in c.messages if m["role"] == "system"), None)
        category = LEAKED_CATEGORY if leaked else HELDOUT_CATEGORY
        rec = {"question_id": c.id, "category": category, "turns": turns}
        if system:
            rec["system"] = system
        lines.append(json.dumps(rec, ensure_ascii=False))
    return "\n".join(lines) + ("\n" if lines else "")


def prepare_data(cfg: Any, tokenizer: Any, force: bool = False) -> PreparedData:
    """Load or build the prepared dataset for (data config, tokenizer)."""
    import datasets

    cfg = DataConfig.from_any(cfg)
    if cfg.truncation not in ("truncate", "drop"):
        raise ValueError(f"data.truncation must be 'truncate' or 'drop', got {cfg.truncation!r}")
    if not 0.0 <= cfg.heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction must be in [0, 1), got {cfg.heldout_fraction}")
    if cfg.split_by not in SPLIT_BY:
        raise ValueError(f"data.split_by must be one of {list(SPLIT_BY)}, got {cfg.split_by!r}")
    ensure_chat_template(tokenizer, cfg.chat_template)
    key = cache_key(cfg, tokenizer)
    root = Path(cfg.cache_dir) if cfg.cache_dir else cache_root() / "data"
    final = root / f"{cfg.name}-{key}"
    if (final / "stats.json").is_file() and not force:
        return _load(final)

    t0 = time.perf_counter()
    convs, load_stats = load_conversations(cfg.source, cfg.path, cfg.max_conversations, on_error=cfg.on_error)
    if not convs:
        raise ValueError(f"no usable conversations in {load_stats.source}: {load_stats.summary()}")
    log.info("%s", load_stats.summary())
    if cfg.first_turn_only:
        convs = [_first_turn(c) for c in convs]
    n_dup = 0
    if cfg.dedupe:
        convs, n_dup = dedupe_conversations(convs)
    train_c, held_c = split_conversations(convs, cfg.heldout_fraction, cfg.split_seed, by=cfg.split_by)
    train_openers = {prompt_key(c) for c in train_c}
    opener_in_train = [prompt_key(c) in train_openers for c in held_c]  # all False by construction with split_by=prompt
    leaked = sum(opener_in_train)
    if leaked:
        log.warning("%d of %d held-out conversations open with a prompt that is also in the training split "
                    "(split_by=%s): held-out metrics on them measure memorization; split_by=prompt avoids it",
                    leaked, len(held_c), cfg.split_by)
    t_load = time.perf_counter() - t0
    tr_cols, tr_counts = tokenize_all(train_c, tokenizer, cfg, "tokenize train")
    he_cols, he_counts = tokenize_all(held_c, tokenizer, cfg, "tokenize held-out")
    if not held_c:
        log.warning("the held-out split is empty (heldout_fraction=%s, split_seed=%s): no validation metrics",
                    cfg.heldout_fraction, cfg.split_seed)
    if tr_counts["examples"] == 0:
        raise ValueError(f"no training example survived tokenization: {tr_counts}")
    if cfg.packing:
        tr_cols, he_cols = pack(tr_cols, cfg.max_length), pack(he_cols, cfg.max_length)
    elapsed = time.perf_counter() - t0
    stats = {
        "config": asdict(cfg), "key": key,
        "load": {"source": load_stats.source, "read": load_stats.read, "kept": load_stats.kept,
                 "superseded": load_stats.superseded,
                 "skipped": dict(load_stats.skipped), "first_skip": dict(load_stats.first_skip), "fixed": dict(getattr(load_stats, "fixed", {}) or {}),
                 "truncated_tail": load_stats.truncated_tail},
        "split": {"by": cfg.split_by, "train_conversations": len(train_c), "heldout_conversations": len(held_c),
                  "duplicates_dropped": n_dup, "heldout_openers_in_train": leaked},
        "train": tr_counts, "heldout": he_counts,
        "rows": {"train": len(tr_cols["input_ids"]), "heldout": len(he_cols["input_ids"])},
        "seconds": {"load": round(t_load, 2), "total": round(elapsed, 2)},
        "records_per_s": round(load_stats.read / max(elapsed, 1e-9), 1),
    }
    with atomic_dir(final) as tmp:
        datasets.Dataset.from_dict(tr_cols).save_to_disk(str(tmp / "train"))
        datasets.Dataset.from_dict(he_cols).save_to_disk(str(tmp / "heldout"))
        (tmp / "heldout_questions.jsonl").write_text(_questions_jsonl(held_c, opener_in_train))
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2))
    log.info("prepared data in %s: %s", final, json.dumps(stats["rows"]))
    return _load(final)


def _load(path: Path) -> PreparedData:
    import datasets

    stats = json.loads((path / "stats.json").read_text())

    def split(name: str):
        if stats["rows"][name] == 0:  # datasets cannot read back an empty saved table
            cols = ["id", "input_ids", "loss_mask"] + (["position_ids", "doc_ids"] if stats["config"]["packing"] else [])
            return datasets.Dataset.from_dict({c: [] for c in cols})
        return datasets.load_from_disk(str(path / name))

    return PreparedData(train=split("train"), heldout=split("heldout"),
                        heldout_questions=path / "heldout_questions.jsonl", stats=stats, path=path)


# ------------------------------------------------------------------------------------------
# Collation
# ------------------------------------------------------------------------------------------

def collate(rows: Sequence[dict[str, Any]], pad_id: int, pad_to_multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch. Packed rows also get per-document position ids and doc ids.

    Returns input_ids [B, T], attention_mask [B, T] (1 = real token), loss_mask [B, T] and, when packed,
    position_ids [B, T] and doc_ids [B, T] (-1 on padding): the model side turns doc_ids into a
    block-diagonal causal mask so packed documents never attend to each other.
    """
    T = max(len(r["input_ids"]) for r in rows)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    lm = torch.zeros((B, T), dtype=torch.long)
    packed = "doc_ids" in rows[0]
    if packed:
        pos = torch.zeros((B, T), dtype=torch.long)
        doc = torch.full((B, T), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        att[i, :n] = 1
        lm[i, :n] = torch.as_tensor(r["loss_mask"])
        if packed:
            pos[i, :n] = torch.as_tensor(r["position_ids"])
            doc[i, :n] = torch.as_tensor(r["doc_ids"])
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": lm}
    if packed:
        batch["position_ids"] = pos
        batch["doc_ids"] = doc
    return batch


def packed_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [B, 1, T, T] (True = attend) from doc ids [B, T] (-1 = padding)."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T, T]
    real = (doc_ids >= 0)[:, :, None]
    m = same & causal & real
    # Padding rows attend to themselves so softmax never sees an all-masked row.
    eye = torch.eye(T, dtype=torch.bool, device=doc_ids.device)
    m = m | (eye & ~real)
    return m[:, None]


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """Target forward kwargs for a collated batch: packed batches get a block-diagonal mask + positions."""
    if "doc_ids" in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": packed_attention_mask(batch["doc_ids"]),
                "position_ids": batch["position_ids"]}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "position_ids": None}


def shifted_valid(batch: dict[str, torch.Tensor], shift: int) -> torch.Tensor:
    """[B, T-shift] bool: position t has a training label at t+shift (an assistant token of the same document).

    This is the one place where the loss mask is aligned with shifted labels: a label at t+shift counts
    when *that* token is an assistant token and, for packed rows, belongs to the same document as t.
    """
    T = batch["input_ids"].shape[1]
    assert 0 < shift < T, (shift, T)
    valid = batch["loss_mask"][:, shift:].bool() & batch["attention_mask"][:, shift:].bool()
    if "doc_ids" in batch:
        valid &= batch["doc_ids"][:, shift:] == batch["doc_ids"][:, : T - shift]
    return valid
