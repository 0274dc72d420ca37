"""The device's verification latency profile: one target forward over w new tokens on a cached context.

It prices a tree: t_verify(width). eval/measure.py reports it; tree=auto (eval/autotree.py) picks trees
with it. Measuring takes a few seconds, so ``cached_latency_profile`` keeps one per device, dtype, thread
count, target (identity and attention kernel), torch version and profile shape under
``$DRAFTHEADS_CACHE/latency/`` (atomic JSON); eval/measure.py re-measures it every run and refreshes the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from draftheads.eval.generate import _clock, crop_cache, tree_forward
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.target import FrozenTarget, dtype_name
from draftheads.heads.target_source import cache_root

log = logging.getLogger(__name__)

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)  # conf/measure.yaml profile.widths
DEFAULT_CONTEXT = 300
DEFAULT_REPEATS = 5


@torch.no_grad()
def latency_profile(target: FrozenTarget, widths: Sequence[int], context: int, repeats: int, seed: int = 0,
                    ) -> dict[str, Any]:
    """Median time of one verification forward of ``w`` tokens on top of ``context`` cached tokens.

    Uses the loop's own ``tree_forward`` (mask + depth positions + logits for every node), with a chain
    mask (a tree of the same width costs the same: the mask only changes which entries are -inf).
    """
    if not widths or min(widths) < 1:
        raise ValueError(f"profile.widths must be positive token counts, got {list(widths)}")
    if int(context) < 1 or int(repeats) < 1:
        raise ValueError(f"profile.context and profile.repeats must be >= 1, got {context}, {repeats}")
    g = torch.Generator().manual_seed(seed)
    V = target.vocab_size
    cache = target.new_cache()
    target(torch.randint(0, V, (1, context), generator=g).to(target.device), cache=cache, logits=False)
    ws = sorted(set(int(x) for x in widths))
    inputs = {w: (torch.randint(0, V, (w,), generator=g), torch.ones(w, w, dtype=torch.bool).tril() if w > 1 else None,
                  torch.arange(w)) for w in ws}
    times: dict[int, list[float]] = {w: [] for w in ws}
    for r in range(int(repeats) + 1):  # round-robin over widths, so load drift hits every width alike
        for w in ws:
            toks, mask, depths = inputs[w]
            t0 = _clock(target.device)
            tree_forward(target, toks, mask, depths, context, cache)
            dt = _clock(target.device) - t0
            crop_cache(cache, context)
            if r:  # the first round is untimed warm-up
                times[w].append(dt)
    out = [{"width": w, "ms": round(1000 * statistics.median(times[w]), 3), "ms_min": round(1000 * min(times[w]), 3)}
           for w in ws]
    t1 = next((o["ms"] for o in out if o["width"] == 1), None)
    for o in out:
        o["ratio_to_t1"] = round(o["ms"] / t1, 3) if t1 else None
    return {"context": int(context), "repeats": int(repeats), "points": out, "t1_ms": t1}


def monotone(ys: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares, pool-adjacent-violators).

    Why: a forward over more tokens never costs less, but on a loaded machine a noisy median can say
    so (e.g. t(4) < t(1)), and a model reading that would price a wider tree below a plain step."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def t_verify_ms(profile: dict[str, Any], width: float) -> float:
    """Verification time at ``width`` tokens: the measured profile made non-decreasing in the width
    (``monotone``), linearly interpolated."""
    pts = sorted(profile["points"], key=lambda p: p["width"])
    return float(np.interp(width, [p["width"] for p in pts], monotone([p["ms"] for p in pts])))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(target: FrozenTarget, widths: Sequence[int], context: int, repeats: int) -> dict[str, Any]:
    """What a latency profile depends on: a cached one is reused only when all of it matches."""
    dev = target.device
    return {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_model(),
            "dtype": dtype_name(target.dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "target": target.identity.to_dict(),
            "attn": str(getattr(target.model.config, "_attn_implementation", None)),
            "widths": sorted(set(int(w) for w in widths)), "context": int(context), "repeats": int(repeats)}


def profile_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "latency" / f"{digest}.json"


def store_profile(profile: dict[str, Any], key: dict[str, Any]) -> Path:
    """Write a measured profile to the cache (atomically) under its key."""
    path = profile_path(key)
    atomic_write_text(path, json.dumps({"key": key, "profile": profile, "measured_at": time.time()}, indent=1))
    return path


def cached_latency_profile(target: FrozenTarget, widths: Sequence[int] = DEFAULT_WIDTHS,
                           context: int = DEFAULT_CONTEXT, repeats: int = DEFAULT_REPEATS, seed: int = 0,
                           ) -> dict[str, Any]:
    """The cached profile for this device/dtype/threads/target/torch, measured (and cached) on first use.

    The returned dict carries ``cache`` = {path, from_cache, measured_at} so results say where t_verify came from.
    """
    key = profile_key(target, widths, context, repeats)
    path = profile_path(key)
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                return {**saved["profile"], "cache": {"path": str(path), "from_cache": True,
                                                      "measured_at": saved.get("measured_at")}}
            log.warning("latency profile cache %s holds another key; re-measuring", path)
        except (OSError, ValueError, KeyError) as e:
            log.warning("unreadable latency profile cache %s (%s); re-measuring", path, e)
    prof = latency_profile(target, widths, context, repeats, seed)
    store_profile(prof, key)
    log.info("latency profile measured and cached at %s", path)
    return {**prof, "cache": {"path": str(path), "from_cache": False, "measured_at": time.time()}}
