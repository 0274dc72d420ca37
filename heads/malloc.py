"""Keep freed CPU memory for reuse instead of handing it back to the kernel (glibc's malloc only).

Why: glibc serves every block above its mmap threshold (32 MiB at most) with fresh pages from the kernel and unmaps
them on free, so each training step page-faults and zeroes its vocabulary-sized logits ([B, T, V] fp32, hundreds of
MB) again. On a 2-core CPU the EAGLE-3 recipe's training step ran 1.2-1.3x faster over 16-20 steps
(``scripts/bench_allocator.py``) and 1.11x over 150 micro-steps with freed memory kept in the heap, at a 25-40%
higher peak RSS (docs/training.md, "CPU memory").

Every entry point calls :func:`keep_freed_memory` once at start. ``DRAFTHEADS_MALLOC=system`` keeps glibc's
defaults, and so does any ``MALLOC_*`` or ``GLIBC_TUNABLES`` setting of your own (yours wins). What one-time setup
frees (a tokenizer's parse buffers) is handed back once with :func:`release_freed_memory`, so a job does not carry
it resident from start to end.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

ENV = "DRAFTHEADS_MALLOC"  # "system": leave glibc's defaults
M_TRIM_THRESHOLD = -1  # <malloc.h>: -1 = never give the heap's free top back to the kernel
M_MMAP_MAX = -4  # <malloc.h>: 0 = never serve a block with its own mmap


CHOICES = ("keep", "system")  # DRAFTHEADS_MALLOC's values (unset: keep)


def glibc_malloc_vars(env: dict[str, str] | os._Environ) -> list[str]:
    """The environment's own glibc malloc settings (``MALLOC_*``, ``GLIBC_TUNABLES``), which always win over ours."""
    return [k for k in env if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]


def user_chose() -> bool:
    """Whether the environment already decides malloc's behaviour (ours must not override it)."""
    value = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"environment variable {ENV}={os.environ[ENV]!r}: allowed values are {list(CHOICES)} "
                         "(unset means keep)")
    return value == "system" or bool(glibc_malloc_vars(os.environ))


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tell glibc to serve large blocks from its heap and keep freed memory; True when it took effect.

    A no-op (False) off Linux, on a libc without ``mallopt`` (musl, macOS), or when :func:`user_chose`."""
    if not sys.platform.startswith("linux") or user_chose():
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1  # mallopt returns 1 on success
    log.debug("malloc: keep freed memory in the heap: %s", ok)
    return ok


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc's ``malloc_trim``); True when it ran.

    Why: loading a target frees large parse buffers (Gemma 3's 262k-id tokenizer.json: ~320 MB on top of the
    ~110 MB the tokenizer keeps) that :func:`keep_freed_memory` would otherwise hold for the whole job. The training
    loop grows the heap again once and keeps it, so its steps still reuse their memory."""
    if not sys.platform.startswith("linux"):
        return False
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
