"""Target features for feature-level drafts, online or captured once to disk (offline).

    python data_prep/features.py [target=...] [data=...] [layers=[-1]] [dtype=bf16] [out=DIR]

Online, the frozen target runs inside the training job; offline, this job runs it once over the
training split and the trainer reads the cache (``features.dir=DIR``). Both reach the objective
through one interface: :func:`training_features` gives the dataset + collate, :func:`batch_hidden`
gives ``{layer: [B, T, H]}`` for a batch — from the batch when it carries ``hidden.<layer>`` tensors,
else from a target forward. Offline rows are the same rows, in the same order, as the tokenized
dataset, so the deterministic data order (train.loop.GlobalBatches) is identical in both modes.

Every shard is written to a temp file and renamed, then recorded in the manifest (also written
atomically); a killed job leaves at most a temp file, which a rerun deletes before continuing with
the first missing shard. The cache's layout, and the checks the trainer makes before reading it:
:mod:`data_prep.feature_cache`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from draftheads.data_prep.dataset import PreparedData, collate, model_inputs, prepare_data
from draftheads.data_prep.feature_cache import (FORMAT, FORMAT_VERSION, MANIFEST, FeatureCache, FeatureDataset,
                                                hidden_key, read_manifest)
from draftheads.heads import job, outputs
from draftheads.heads.checkpoint import atomic_write_text, save_safetensors
from draftheads.heads.target import DTYPE_NAMES, FrozenTarget, load_target, parse_dtype, resolve_device

log = logging.getLogger(__name__)


def resolve_layers(layers: Sequence[int] | int, num_layers: int) -> list[int]:
    """Concrete, sorted, unique hidden-state indices (-1 = L) with a clear error when out of range."""
    if isinstance(layers, int):
        layers = [layers]
    out = set()
    for l in layers:
        l = int(l)
        if not -1 <= l <= num_layers:
            raise ValueError(f"layer {l} outside the target's hidden states -1, 0..{num_layers}")
        out.add(num_layers if l == -1 else l)
    if not out:
        raise ValueError("no feature layers requested")
    return sorted(out)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def bytes_per_token(layers: Sequence[int], hidden_size: int, dtype: torch.dtype) -> int:
    return len(layers) * hidden_size * torch.empty((), dtype=dtype).element_size()


# ------------------------------------------------------------------------------------------
# The one interface the trainer uses
# ------------------------------------------------------------------------------------------

def batch_hidden(batch: dict[str, torch.Tensor], target: FrozenTarget, layers: Sequence[int],
                 ) -> dict[int, torch.Tensor]:
    """{layer: [B, T, H]} for a collated batch: cached features when the batch carries them, else the target's."""
    keys = [hidden_key(l) for l in layers]
    present = [k in batch for k in keys]
    if all(present):
        return {l: batch[k] for l, k in zip(layers, keys)}
    if any(present):
        raise ValueError(f"batch carries only some of the feature layers {list(layers)}: "
                         f"{[k for k in batch if k.startswith('hidden.')]}")
    out = target(**model_inputs(batch), layers=list(layers), logits=False)
    return {l: out["hidden"][l] for l in layers}


def feature_collate(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """``collate`` plus the rows' cached features right-padded to the batch: hidden.<layer> [B, T, H]."""
    batch = collate(rows, pad_id)
    B, T = batch["input_ids"].shape
    for k in [k for k in rows[0] if k.startswith("hidden.")]:
        h0 = rows[0][k]
        out = torch.zeros(B, T, h0.shape[-1], dtype=h0.dtype)
        for i, r in enumerate(rows):
            out[i, : r[k].shape[0]] = r[k]
        batch[k] = out
    return batch


def training_features(features_dir: str | None, target: FrozenTarget, data: PreparedData, layers: Sequence[int],
                      pad_id: int) -> tuple[Any, Any, str]:
    """(train dataset, collate, description): the tokenized rows (online) or rows + cached features (offline)."""
    if not features_dir:
        return data.train, (lambda rows: collate(rows, pad_id)), "online"
    cache = FeatureCache(features_dir)
    cache.check(target, layers, data)
    return FeatureDataset(data.train, cache, layers), (lambda rows: feature_collate(rows, pad_id)), \
        f"offline:{features_dir}"


# ------------------------------------------------------------------------------------------
# Capturing
# ------------------------------------------------------------------------------------------

def plan_shards(num_rows: int, rows_per_shard: int) -> list[tuple[int, int]]:
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    return [(a, min(a + rows_per_shard, num_rows)) for a in range(0, num_rows, rows_per_shard)]


def shard_batches(lengths: Sequence[int], start: int, end: int, batch_size: int) -> list[list[int]]:
    """Row indices of one shard grouped into forward batches of similar length (less padding)."""
    idx = sorted(range(start, end), key=lambda i: (-lengths[i], i))
    return [idx[j:j + batch_size] for j in range(0, len(idx), batch_size)]


@torch.no_grad()
def capture_batch(target: FrozenTarget, rows: Sequence[dict[str, Any]], layers: Sequence[int], dtype: torch.dtype,
                  pad_id: int) -> list[dict[int, torch.Tensor]]:
    """One target forward; returns each row's unpadded features {layer: [n_i, H]} on CPU in ``dtype``."""
    batch = collate(rows, pad_id)
    batch = {k: v.to(target.device) for k, v in batch.items()}
    hid = batch_hidden(batch, target, layers)
    out = []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        out.append({l: hid[l][i, :n].to("cpu", dtype) for l in layers})
    return out


def write_shard(path: Path, per_row: Sequence[dict[int, torch.Tensor]], layers: Sequence[int]) -> int:
    """Atomically write one shard (temp file + rename); returns its size in bytes."""
    lengths = [r[layers[0]].shape[0] for r in per_row]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    tensors = {hidden_key(l): torch.cat([r[l] for r in per_row]).contiguous() for l in layers}
    tensors["offsets"] = offsets
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_safetensors(tensors, tmp, metadata={"format": FORMAT})  # the umask's mode, not 0600
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    return path.stat().st_size


def _plan_fields(m: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields that must match for a rerun to continue an existing cache."""
    return {"target.fingerprint": m["target"]["fingerprint"], "target.name": m["target"]["name"],
            "layers": m["layers"], "dtype": m["dtype"], "hidden_size": m["hidden_size"],
            "data.key": m["data"]["key"], "data.rows": m["data"]["rows"], "rows_per_shard": m["rows_per_shard"]}


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    job.config_int(cfg, "batch_size", None, 1)  # 0: a clear error before any model load
    outputs.refuse_foreign(Path(cfg.out), MANIFEST, "feature cache")  # fills out in place: never a user's folder
    outputs.claim(Path(cfg.out), "features")  # one writer per cache
    device = resolve_device(cfg.device)
    target = load_target(cfg.target, device=device)
    data = prepare_data(cfg.data, target.tokenizer)
    layers = resolve_layers(cfg.layers if isinstance(cfg.layers, int) else list(cfg.layers), target.num_layers)
    dtype = parse_dtype(cfg.dtype, device)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of bf16, fp16, fp32, got {cfg.dtype!r}")
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    ds = data.train
    lengths = [len(x) for x in ds["input_ids"]]
    shards = plan_shards(len(ds), int(cfg.rows_per_shard))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "target": target.identity.to_dict(),
        "layers": layers, "dtype": DTYPE_NAMES[dtype], "hidden_size": target.hidden_size,
        "bytes_per_token": bytes_per_token(layers, target.hidden_size, dtype),
        "data": {"name": data.stats["config"]["name"], "key": data.stats.get("key"), "split": "train",
                 "rows": len(ds), "tokens": sum(lengths),
                 "assistant_tokens": int(data.stats.get("train", {}).get("assistant_tokens", 0))},
        "rows_per_shard": int(cfg.rows_per_shard), "num_shards": len(shards), "shards": [], "complete": False,
    }
    if (out / MANIFEST).is_file():  # resume: the existing cache must be for exactly this plan
        old = read_manifest(out)
        a, b = _plan_fields(old), _plan_fields(manifest)
        for k in a:
            if a[k] != b[k]:
                raise ValueError(f"{out / MANIFEST} was written for another plan: field {k} is {a[k]!r} there, this "
                                 f"run has {b[k]!r}. Use another out= directory or delete {out}")
        manifest["shards"] = [s for s in old["shards"] if (out / s["file"]).is_file()
                              and (out / s["file"]).stat().st_size == s["bytes"]]
        manifest["capture"] = old.get("capture", {})
    for p in out.iterdir():  # temp files of a killed job, and shards never recorded in the manifest
        recorded = {s["file"] for s in manifest["shards"]}
        if p.name.startswith(".shard-") or (p.name.startswith("shard-") and p.name not in recorded):
            log.warning("removing %s (left by an interrupted run)", p)
            p.unlink()
    done = {tuple(s["rows"]) for s in manifest["shards"]}
    todo = [(k, a, b) for k, (a, b) in enumerate(shards) if (a, b) not in done]
    total = manifest["data"]["tokens"] * manifest["bytes_per_token"]
    left = sum(lengths[i] for _, a, b in todo for i in range(a, b)) * manifest["bytes_per_token"]
    msg = (f"feature cache {out}: {manifest['data']['tokens']} tokens × {len(layers)} layer(s) {layers} × "
           f"hidden {target.hidden_size} × {DTYPE_NAMES[dtype]} = {human_bytes(total)} expected on disk; "
           f"{len(shards) - len(todo)}/{len(shards)} shards already written, {human_bytes(left)} to write")
    log.info(msg)
    print(msg, flush=True)
    free = shutil.disk_usage(out).free
    if left > free:
        raise ValueError(f"feature cache needs {human_bytes(left)} more but {out} has only {human_bytes(free)} free")
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    # ---- loop
    t0, tokens, fwd_s = time.perf_counter(), 0, 0.0
    bar = tqdm(total=len(todo), desc="features", unit="shard", mininterval=2.0)
    for k, a, b in todo:
        per_row: dict[int, dict[int, torch.Tensor]] = {}
        for idx in shard_batches(lengths, a, b, int(cfg.batch_size)):
            t1 = time.perf_counter()
            for i, feats in zip(idx, capture_batch(target, [ds[i] for i in idx], layers, dtype, pad_id)):
                per_row[i] = feats
            fwd_s += time.perf_counter() - t1
        name = f"shard-{k:05d}.safetensors"
        size = write_shard(out / name, [per_row[i] for i in range(a, b)], layers)
        n = sum(lengths[a:b])
        tokens += n
        manifest["shards"].append({"file": name, "rows": [a, b], "tokens": n, "bytes": size})
        manifest["shards"].sort(key=lambda s: s["rows"][0])
        atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    elapsed = time.perf_counter() - t0
    disk = sum(s["bytes"] for s in manifest["shards"])
    manifest["complete"] = True
    manifest["disk_bytes"] = disk
    if todo:
        manifest["capture"] = {"seconds": round(elapsed, 2), "tokens": tokens,
                               "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1),
                               "forward_seconds": round(fwd_s, 2), "device": str(target.device)}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    summary = {"out": str(out), "shards_written": len(todo), "shards": len(shards), "tokens": tokens,
               "seconds": round(elapsed, 2), "tokens_per_s": round(tokens / max(elapsed, 1e-9), 1),
               "disk_bytes": disk, "expected_bytes": total,
               "bytes_per_token": round(disk / max(1, manifest["data"]["tokens"]), 1)}
    log.info("features done: %s", json.dumps(summary))
    print(json.dumps(summary), flush=True)
    return summary


@job.main(config_name="features")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
