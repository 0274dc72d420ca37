"""What a job may write: ownership of output folders, one writer per output, and disk errors as user errors.

Why: an export or a publish pointed at a folder that already holds a user's files (their run, their head, or
anything else) must not empty it, and two jobs writing one output at once must not interleave. Three rules:

- A folder written whole (:func:`draftheads.heads.checkpoint.atomic_dir`) carries a manifest, :data:`MANIFEST`,
  naming the job that wrote it and every file it wrote. Such a folder is replaced only by the same job, and only
  when it holds nothing else; a folder without a manifest is replaced only when every file in it is one that the
  new write also writes (an internal folder written before manifests existed, e.g. a run's ``final/``), and never
  when the writer is a user-facing job that names itself (export, publish).
- :func:`claim` takes a lock file beside an output (``.<name>.lock``) for the life of the job; a second job gets
  one line naming the holder; a lock whose process has died is taken over with a warning.
- :func:`os_error_message` turns the operating-system errors of writing an output (a file where a folder is
  needed, no permission, a read-only or full disk) into one line naming the path and the way out.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

MANIFEST = ".draftheads-output.json"


# ------------------------------------------------------------------------------------------
# Ownership
# ------------------------------------------------------------------------------------------

def list_files(root: Path) -> list[str]:
    """Every file under ``root`` (relative POSIX paths, sorted), the manifest aside."""
    root = Path(root)
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = (Path(dirpath) / n).relative_to(root).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's output manifest, or None when it has none (or an unreadable one: then it proves nothing)."""
    try:
        m = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("files"), list) else None


def write_manifest(folder: Path, job: str) -> None:
    """Record what ``folder`` (a temporary folder about to be renamed into place) holds and who wrote it."""
    m = {"job": job, "files": list_files(folder), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (Path(folder) / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")


def _names(files: Iterable[str], n: int = 3) -> str:
    files = sorted(files)
    return ", ".join(files[:n]) + (f" and {len(files) - n} more" if len(files) > n else "")


def check_replaceable(final: Path, job: str | None, new_files: Iterable[str] = (), overwrite: bool = True,
                      key: str = "out") -> None:
    """Raise ValueError unless writing ``final`` whole would remove only files an earlier write of ``job`` made.

    ``job`` None is an internal write (a run's ``final/``, ``best/``, a data cache): a file the new write also has
    (``new_files``) counts as its own, so an unmarked folder written before manifests existed is replaceable too. ``overwrite`` False refuses
    even a replaceable earlier output (user-facing jobs replace only when asked)."""
    final = Path(final)
    if not final.exists():
        return
    if not final.is_dir():
        raise ValueError(f"{key}={final} is a file, not a folder: choose a folder path that does not exist yet")
    existing = set(list_files(final))
    if not existing:
        return
    m = read_manifest(final)
    if m is not None and job is not None and m.get("job") != job:
        raise ValueError(f"{key}={final} holds a {m.get('job')} output, not a {job} one: this job never replaces "
                         f"another job's output; choose another {key}")
    owned = set(m["files"]) if m is not None else set()
    if job is None:  # an internal folder: a file the new write also has is replaced, not lost
        owned |= set(new_files)
    foreign = existing - owned
    if foreign:
        what = f"an earlier {m.get('job')} output plus " if m is not None else ""
        raise ValueError(f"{key}={final} already holds {what}{len(foreign)} file(s) this job did not write "
                         f"({_names(foreign)}): it writes only into a new or empty folder, or over its own earlier "
                         f"output; choose another {key} (nothing was changed)")
    if not overwrite:
        raise ValueError(f"{key}={final} holds an earlier {job} output (written {m.get('written', '?') if m else '?'}):"
                         f" pass overwrite=true to replace it, or choose another {key}")


def refuse_inside(out: Path, protected: dict[str, Path | None], key: str = "out") -> None:
    """An output folder may not be, or contain, the inputs it is made from (the head, its training run):
    replacing it would delete them."""
    o = Path(out).resolve()
    for name, p in protected.items():
        if p is None:
            continue
        p = Path(p).resolve()
        if o == p or o in p.parents:
            raise ValueError(f"{key}={out} would replace the {name} {p} (an output folder is written whole): "
                             f"choose a new folder outside it (nothing was changed)")


def refuse_foreign(folder: Path, marker: str, what: str, key: str = "out") -> None:
    """A job that fills a folder in place (a feature cache) writes only into a new or empty folder or one that
    already holds its own ``marker`` file."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{key}={folder} is a file, not a folder: choose a folder path")
    if folder.is_dir() and not (folder / marker).exists():
        files = [p.name for p in folder.iterdir() if not p.name.startswith(".")]
        if files:
            raise ValueError(f"{key}={folder} holds {len(files)} file(s) that are not a {what} ({_names(files)}): "
                             f"choose a new or empty folder (nothing was changed)")


# ------------------------------------------------------------------------------------------
# One writer per output
# ------------------------------------------------------------------------------------------

_HELD: dict[Path, "OutputLock"] = {}


def lock_path(out: Path) -> Path:
    out = Path(out).absolute()
    return out.parent / f".{out.name}.lock"


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live holder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot tell: another machine's process
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = holder.get("start_ticks")
    return started is None or _start_ticks(pid) in (None, started)


class OutputLock:
    """A lock file beside an output, held from :func:`claim` until :meth:`release` (or the process ends)."""

    def __init__(self, out: Path, job: str):
        self.out, self.job, self.path = Path(out), job, lock_path(out)

    def _info(self) -> dict[str, Any]:
        return {"job": self.job, "pid": os.getpid(), "host": socket.gethostname(),
                "start_ticks": _start_ticks(os.getpid()), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "out": str(self.out)}

    def acquire(self) -> "OutputLock":
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._info()))
        except OSError as e:  # name the output the user chose, not the lock's temp file
            raise OSError(e.errno, e.strerror, str(self.out)) from e
        try:
            for _ in range(5):
                try:
                    os.link(tmp, self.path)  # atomic create-if-absent, with its content already there
                    return self
                except FileExistsError:
                    pass
                holder = self._holder()
                if holder is None:  # vanished or half-written by a non-draftheads tool: look again
                    time.sleep(0.05)
                    holder = self._holder() or {}
                if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                    return self  # this process already holds it (a job run twice in one process)
                if _alive(holder):
                    raise ValueError(
                        f"{self.out} is being written by another job: {holder.get('job', '?')} (pid "
                        f"{holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}); "
                        f"wait for it to finish or choose another output (lock file {self.path})")
                print(f"warning: taking over the lock {self.path}: its holder, {holder.get('job', '?')} pid "
                      f"{holder.get('pid', '?')} since {holder.get('since', '?')}, is no longer running",
                      file=sys.stderr, flush=True)
                log.warning("took over the stale lock %s (%s)", self.path, holder)
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            raise ValueError(f"could not take the lock {self.path} for {self.out}: it keeps changing hands")
        finally:
            tmp.unlink(missing_ok=True)

    def _holder(self) -> dict[str, Any] | None:
        try:
            h = json.loads(self.path.read_text())
            return h if isinstance(h, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        holder = self._holder()
        if holder is not None and holder.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        _HELD.pop(self.path, None)


def claim(out: str | os.PathLike, job: str) -> OutputLock:
    """Hold the lock on ``out`` until :func:`release_all` (each job entry calls it when the job ends) or exit."""
    lock = OutputLock(Path(out), job).acquire()
    _HELD[lock.path] = lock
    return lock


def release_all() -> None:
    for lock in list(_HELD.values()):
        try:
            lock.release()
        except OSError:  # pragma: no cover - the folder went away
            pass


atexit.register(release_all)


# ------------------------------------------------------------------------------------------
# Operating-system errors of writing outputs
# ------------------------------------------------------------------------------------------

_WAYS_OUT = {
    errno.ENOSPC: "the disk is full: free space or choose an output on another disk, then rerun (the job resumes "
                  "or rewrites only what was not finished)",
    errno.EDQUOT: "the disk quota is used up: free space or choose an output elsewhere, then rerun",
    errno.EFBIG: "the file is larger than this filesystem or a size limit (ulimit -f) allows: choose an output on "
                 "another disk or raise the limit, then rerun",
    errno.EROFS: "the filesystem is read-only: choose an output on a writable disk",
    errno.EACCES: "no permission: choose an output you may write, or fix its permissions",
    errno.EPERM: "the operation is not permitted there: choose an output you may write",
    errno.ENOTDIR: "a file stands where a folder is needed: choose another path or move that file",
    errno.EEXIST: "a file stands where a folder is needed: choose another path or move that file",
    errno.EISDIR: "a folder stands where a file is needed: choose another path",
    errno.ENAMETOOLONG: "the path is too long: choose a shorter one",
}
USER_ERRNOS = frozenset(_WAYS_OUT)


def os_error_message(exc: OSError) -> str:
    """One line for an operating-system error a user can fix: what failed, on which path, and the way out."""
    path = exc.filename if exc.filename is not None else "?"
    if exc.filename2 is not None:
        path = f"{path} -> {exc.filename2}"
    reason = exc.strerror or type(exc).__name__
    return f"cannot use {path}: {reason} — {_WAYS_OUT.get(exc.errno, 'check the path')}"
