"""The offline feature cache on disk: its format, and reading it back for training (verified, memory-mapped).

Layout::

    manifest.json             format, target identity, layers, dtype, hidden size, data key, rows,
                              token counts, rows_per_shard, the shards written so far, complete flag
    shard-00000.safetensors   rows [a, b): "hidden.<layer>" [tokens, H] (dtype), "offsets" [rows+1] int64

Apart from the capture job (``features.py``, which writes it) because the trainer only reads: it refuses a cache
that is incomplete, was made for another target, other layers or other data, or whose shard files do not have the
recorded size.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open

from draftheads.data_prep.dataset import PreparedData
from draftheads.heads.target import FrozenTarget, check_identity, parse_dtype

FORMAT = "draftheads-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def hidden_key(layer: int) -> str:
    return f"hidden.{layer}"


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise ValueError(f"{path} is not a feature cache: {f} does not exist (write one with data_prep/features.py)")
    try:
        m = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if m.get("format") != FORMAT:
        raise ValueError(f"{f}: field format is {m.get('format')!r}, expected {FORMAT!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{f}: field format_version is {m.get('format_version')!r}, expected {FORMAT_VERSION}")
    return m


class FeatureCache:
    """A complete, verified feature cache; ``row(i, layers)`` reads one example's features (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        mf = self.path / MANIFEST
        if not m.get("complete"):
            raise ValueError(f"feature cache {self.path} is incomplete: {len(m.get('shards', []))} of "
                             f"{m.get('num_shards')} shards written ({mf}: complete=false). Rerun "
                             f"data_prep/features.py with the same settings and out={self.path} to resume it")
        self.layers = list(m["layers"])
        self.dtype = parse_dtype(m["dtype"])
        self.starts: list[int] = []
        self.shards: list[dict[str, Any]] = m["shards"]
        expect_start = 0
        for s in self.shards:
            f = self.path / s["file"]
            if not f.is_file():
                raise ValueError(f"feature cache {self.path}: shard file {f} listed in {mf} is missing")
            size = f.stat().st_size
            if size != s["bytes"]:
                raise ValueError(f"feature cache shard {f} has {size} bytes, {mf} expects {s['bytes']}: the file "
                                 f"is truncated or was rewritten (a killed copy?); rerun data_prep/features.py")
            if s["rows"][0] != expect_start:
                raise ValueError(f"{mf}: shard {s['file']} starts at row {s['rows'][0]}, expected {expect_start}")
            self.starts.append(s["rows"][0])
            expect_start = s["rows"][1]
        if expect_start != m["data"]["rows"]:
            raise ValueError(f"{mf}: shards cover {expect_start} rows, field data.rows is {m['data']['rows']}")
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def check(self, target: FrozenTarget, layers: Sequence[int], data: PreparedData) -> None:
        """Refuse a cache made for another target, other layers, or other tokenized data."""
        mf = self.path / MANIFEST
        check_identity(self.manifest["target"], target.identity, f"feature cache {mf}")
        missing = [l for l in layers if l not in self.layers]
        if missing:
            raise ValueError(f"feature cache {mf}: field layers is {self.layers}, this run needs {list(layers)} "
                             f"(missing {missing}); capture them with data_prep/features.py layers={list(layers)}")
        if self.manifest["hidden_size"] != target.hidden_size:
            raise ValueError(f"feature cache {mf}: field hidden_size is {self.manifest['hidden_size']}, the target "
                             f"has {target.hidden_size}")
        d = self.manifest["data"]
        key = data.stats.get("key")
        if d.get("key") != key:
            raise ValueError(f"feature cache {mf}: field data.key is {d.get('key')!r}, the prepared training data "
                             f"has key {key!r} (a different data config or tokenizer); recapture the features")
        if d["rows"] != len(data.train):
            raise ValueError(f"feature cache {mf}: field data.rows is {d['rows']}, the training split has "
                             f"{len(data.train)} rows")

    def __len__(self) -> int:
        return int(self.manifest["data"]["rows"])

    def _open(self, s: int) -> tuple[Any, list[int]]:
        if s not in self._handles:
            f = self.path / self.shards[s]["file"]
            try:
                h = safe_open(str(f), framework="pt")
                offsets = h.get_tensor("offsets").tolist()
            except Exception as e:  # safetensors raises its own types for corrupt headers
                raise ValueError(f"could not read feature cache shard {f}: {e}") from None
            rows = self.shards[s]["rows"]
            if len(offsets) != rows[1] - rows[0] + 1:
                raise ValueError(f"feature cache shard {f} holds {len(offsets) - 1} rows, the manifest says "
                                 f"{rows[1] - rows[0]}")
            self._handles[s], self._offsets[s] = h, offsets
        return self._handles[s], self._offsets[s]

    def row(self, i: int, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """{layer: [n_i, H]} of example i."""
        s = bisect.bisect_right(self.starts, i) - 1
        h, off = self._open(s)
        j = i - self.starts[s]
        return {l: h.get_slice(hidden_key(l))[off[j]:off[j + 1]] for l in layers}


class FeatureDataset:
    """The tokenized rows with their cached features: ``ds[i]`` adds ``hidden.<layer>`` [n_i, H];
    ``ds["input_ids"]`` (any column) is the underlying column, which is what the Trainer reads lengths from."""

    def __init__(self, base: Any, cache: FeatureCache, layers: Sequence[int]):
        if len(base) != len(cache):
            raise ValueError(f"feature cache {cache.path} has {len(cache)} rows, the dataset has {len(base)}")
        self.base, self.cache, self.layers = base, cache, list(layers)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            return self.base[key]
        row = dict(self.base[int(key)])
        n = len(row["input_ids"])
        for l, h in self.cache.row(int(key), self.layers).items():
            if h.shape[0] != n:
                raise ValueError(f"feature cache {self.cache.path}: row {key} has {h.shape[0]} feature tokens, the "
                                 f"dataset row has {n} tokens; the cache belongs to other data — recapture it")
            row[hidden_key(l)] = h
        return row
