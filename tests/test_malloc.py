"""heads/malloc.py: entry points keep freed CPU memory for reuse, so a step's large tensors are not page-faulted
and zeroed again every time; the user's own malloc settings win. Each case runs in a fresh process (malloc
settings are process-wide and must not leak into the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftheads.heads import job, malloc

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import ctypes, resource, torch
# 4 KiB pages whatever the host's THP setting: with transparent huge pages (enabled=always, or torch's
# THP_MEM_ALLOC_ENABLE=1) a fresh 64 MiB tensor faults ~32 huge pages, not 16,384 small ones
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
from draftheads.heads.malloc import keep_freed_memory
applied = keep_freed_memory()
def once():
    x = torch.ones(2 ** 24)  # 64 MiB, every page written
    del x
once(); once()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    once()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""

def _is_glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


glibc = pytest.mark.skipif(not _is_glibc(), reason="glibc's mallopt only")


def _probe(**env: str) -> tuple[bool, int]:
    e = {k: v for k, v in os.environ.items() if k != malloc.ENV and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    e.update(env, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE], env=e, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.slow  # 8-14 s: a whole job chain or a child process; the fast tier keeps the unit checks
@glibc
def test_freed_memory_is_reused_without_page_faults_and_the_users_choice_wins():
    pages = 5 * (2 ** 26 // os.sysconf("SC_PAGE_SIZE"))  # five 64 MiB tensors
    applied, faults = _probe()
    # served from the kept heap: no new pages, or one tensor's worth when the heap's top is reused for something
    # else in between (seen once in 6 probes: 16,385 of 81,920); glibc's defaults fault every page every time
    assert applied and faults <= 0.25 * pages
    for env in ({malloc.ENV: "system"}, {"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}):
        applied, faults = _probe(**env)
        assert not applied and faults > 0.9 * pages, env  # glibc's defaults: fresh pages for every tensor


def test_user_chose_reads_the_environment(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", malloc.ENV)]:
        monkeypatch.delenv(k)
    assert not malloc.user_chose()
    monkeypatch.setenv(malloc.ENV, "System")
    assert malloc.user_chose()
    monkeypatch.setenv(malloc.ENV, "keep")
    assert not malloc.user_chose()
    monkeypatch.setenv(malloc.ENV, "sytem")  # a typo is an error, not a silent "keep"
    with pytest.raises(ValueError, match="DRAFTHEADS_MALLOC='sytem': allowed values are"):
        malloc.user_chose()
    monkeypatch.setenv(malloc.ENV, "keep")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert malloc.user_chose()


def test_process_entries_apply_it(monkeypatch):
    calls = []
    monkeypatch.setattr(job, "keep_freed_memory", lambda: calls.append(1) or True)
    with pytest.raises(SystemExit):
        job.cli(lambda: 0)
    assert calls == [1]


def test_a_bad_setting_is_one_line_in_the_benchmark_entry_too():
    """scripts/bench_distill.py applies the setting itself (it records it): a typo exits 2 with one line there too."""
    e = dict(os.environ, **{malloc.ENV: "sytem"})
    out = subprocess.run([sys.executable, "scripts/bench_distill.py", "--help"], env=e, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: environment variable DRAFTHEADS_MALLOC='sytem': allowed values are ['keep', 'system'] (unset means keep)"]
    assert "Traceback" not in out.stderr and out.stdout == ""


RELEASE = """
import torch
from draftheads.heads.malloc import keep_freed_memory, release_freed_memory
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2 ** 20
assert keep_freed_memory()
xs = [torch.ones(2 ** 24) for _ in range(4)]  # 4 x 64 MiB, every page written, served from the heap
del xs
kept = rss()
ran = release_freed_memory()
print(ran, kept - rss())
"""


@pytest.mark.slow  # a child process (malloc settings are process-wide)
@glibc
def test_what_setup_freed_is_handed_back_once():
    """Kept memory stays resident until release_freed_memory (which load_target calls once, after loading)."""
    e = {k: v for k, v in os.environ.items() if k != malloc.ENV and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", RELEASE], env=dict(e, OMP_NUM_THREADS="1"), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ran, released = out.stdout.split()
    assert ran == "True" and float(released) >= 200  # of the 256 MiB freed


def test_load_target_hands_back_what_loading_freed(monkeypatch, tiny_target_dir):
    from draftheads.heads import target as tg

    calls = []
    monkeypatch.setattr(tg, "release_freed_memory", lambda: calls.append(1) or True)
    tg.load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    assert calls == [1]
