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

FORMAT = "draftheads"
FORMAT_VERSION = 1


def atomic_dir(final: str | os.PathLike) -> "AtomicDir":
    """Context manager: yields a temp dir next to ``final`` and renames it into place on success."""
    return AtomicDir(Path(final))


class AtomicDir:
    def __init__(self, final: Path):
        self.final = final
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
        os.chmod(self.tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the dir what mkdir() would have
        if self.final.exists():
            # Move the old one aside first so that at every instant one complete copy exists.
            old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
            os.replace(self.final, old)
            os.replace(self.tmp, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.final)


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
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def save_head(path: str | os.PathLike, family: str, head_config: dict[str, Any], target: dict[str, Any],
              state_dict: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> Path:
    """Atomically write a head checkpoint directory."""
    with atomic_dir(path) as tmp:
        write_head_files(tmp, family, head_config, target, state_dict, extra)
    return Path(path)


def read_head(path: str | os.PathLike, family: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read (config, tensors) of a head checkpoint with clear errors for wrong or partial directories."""
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
