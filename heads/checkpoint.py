"""Head checkpoints: safetensors weights + config.json, written atomically, tied to a target.

Layout of a checkpoint directory::

    config.json        {"format": "draftheads", "family": "medusa", "head_config": {...}, "target": {...}, ...}
    model.safetensors  the draft's own trainable weights (never the frozen target's)

Why: a serving engine or a later eval must know which target a head belongs to and how to rebuild
the module; safetensors avoids unpickling untrusted files; writing into a temp dir and renaming
means a killed job never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import load_file, save_file

from draftheads.heads.outputs import check_replaceable, list_files, write_manifest

FORMAT = "draftheads"
FORMAT_VERSION = 1


def atomic_dir(final: str | os.PathLike, owner: str | None = None) -> "AtomicDir":
    """Context manager: yields a temp dir next to ``final`` and renames it into place on success.

    ``owner`` names a user-facing job (``export``, ``publish``): an existing ``final`` is then replaced only when
    its manifest says that job wrote it and it holds nothing else; with None (a run's ``final/``, ``best/``, a
    cache) an unmarked folder is replaced only when it holds no file the new one lacks (heads/outputs.py)."""
    return AtomicDir(Path(final), owner)


class AtomicDir:
    def __init__(self, final: Path, owner: str | None = None):
        self.final = final
        self.owner = owner
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.tmp-", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            write_manifest(self.tmp, self.owner or "draftheads")
            # Never remove what this kind of write did not make: refused here, the old folder stays as it was.
            check_replaceable(self.final, self.owner, list_files(self.tmp))
            os.chmod(self.tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the dir what mkdir() would have
            if self.final.is_dir():
                # Move the old one aside first so that at every instant one complete copy exists.
                old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
                os.replace(self.final, old)
                os.replace(self.tmp, self.final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.tmp, self.final)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a UTF-8 text file via a temp file + rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temp file beside it, renamed over it when the block ends
    without an error, removed when it raises, so readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file what open() would have
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write() names no file: name the output
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file via a temp file + rename (:func:`atomic_open`)."""
    with atomic_open(path) as f:
        f.write(data)


def write_head_files(directory: Path, family: str, head_config: dict[str, Any], target: dict[str, Any],
                     state_dict: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> None:
    """Write config.json + model.safetensors into an (already temporary) directory."""
    cfg = {"format": FORMAT, "format_version": FORMAT_VERSION, "family": family,
           "head_config": head_config, "target": target, **(extra or {})}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_safetensors(tensors, directory / "model.safetensors", metadata={"format": "pt", "family": family})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with the permissions ``open()`` would give (the umask's).

    The safetensors writer creates its file 0600 (a private temp file renamed into place), so heads and
    exports were unreadable to the group/others that can read every other output."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:  # safetensors reports a failed write as its own error type, "... (os error 28)"
        raise _as_os_error(e, path) from e
    os.chmod(path, 0o666 & ~_umask())


def _as_os_error(e: BaseException, path: str | os.PathLike) -> BaseException:
    """The OSError behind a library's write error (its errno named in the message), else the error itself."""
    import re

    m = re.search(r"os error (\d+)", str(e))
    if isinstance(e, OSError) or m is None:
        return e
    code = int(m.group(1))
    return OSError(code, os.strerror(code), str(path))


class _WriteRecorder:
    """A binary file whose failed write() is remembered: torch.save turns it into a RuntimeError with no errno."""

    def __init__(self, f: BinaryIO):
        self.f, self.error = f, None

    def write(self, b: bytes) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` whose write errors (disk full, read-only) surface as an ``OSError`` naming ``path``
    (jobs report those as one-line user errors) instead of torch's "unexpected pos" RuntimeError."""
    with open(path, "wb") as f:
        rec = _WriteRecorder(f)
        try:
            torch.save(obj, rec)
        except RuntimeError as e:
            if rec.error is not None:
                raise OSError(rec.error.errno, rec.error.strerror, str(path)) from e
            raise


def save_head(path: str | os.PathLike, family: str, head_config: dict[str, Any], target: dict[str, Any],
              state_dict: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> Path:
    """Atomically write a head checkpoint directory."""
    with atomic_dir(path) as tmp:
        write_head_files(tmp, family, head_config, target, state_dict, extra)
    return Path(path)


def read_head_config(path: str | os.PathLike, family: str | None = None) -> dict[str, Any]:
    """The config.json of a head checkpoint (without loading its tensors), with clear errors for wrong or partial
    directories: what evaluation reads to size trees and training to carry a head's bookkeeping on."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not path.is_dir():
        raise ValueError(f"head checkpoint {path} does not exist or is not a directory")
    if not cfg_file.is_file() or not weights.is_file():
        missing = [p.name for p in (cfg_file, weights) if not p.is_file()]
        raise ValueError(f"head checkpoint {path} is incomplete: missing {', '.join(missing)}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"head checkpoint {cfg_file} is not valid JSON: {e}") from None
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} is not a draftheads checkpoint (format={cfg.get('format')!r}); "
                         f"exported serving-engine layouts cannot be loaded back for training")
    if family is not None and cfg.get("family") != family:
        raise ValueError(f"{path} holds a {cfg.get('family')!r} head, expected {family!r}")
    return cfg


def read_head(path: str | os.PathLike, family: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read (config, tensors) of a head checkpoint with clear errors for wrong or partial directories."""
    cfg = read_head_config(path, family)
    weights = Path(path) / "model.safetensors"
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for truncated files
        raise ValueError(f"could not read {weights}: {e}") from None
    check_finite(tensors, weights)
    return cfg, tensors


def check_finite(tensors: dict[str, torch.Tensor], source: str | os.PathLike) -> None:
    """Refuse weights holding NaN or Inf, naming the file and tensor: such a head drafts garbage (or nothing)
    and an eval would report its τ without a word."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise ValueError(f"{source}: tensor {name!r} {tuple(t.shape)} holds {n_nan} NaN and {n_inf} Inf values; "
                             f"the checkpoint is corrupt or training diverged (retrain, or use an earlier checkpoint)")
