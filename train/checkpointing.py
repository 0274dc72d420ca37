"""Checkpoint layout and RNG state: ``step-N/`` directories and everything an exact resume restores
besides weights and optimizer (see ``Trainer.save_checkpoint`` / ``try_resume``)."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch


log = logging.getLogger(__name__)

CKPT_RE = re.compile(r"^step-(\d+)$")


# ------------------------------------------------------------------------------------------
# RNG state (saved without pickle: tensors and lists only, loadable with weights_only=True)
# ------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    py = random.getstate()
    npst = np.random.get_state()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], torch.from_numpy(npst[1].astype(np.int64)), npst[2], npst[3], npst[4]],
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    n = st["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ------------------------------------------------------------------------------------------
# Checkpoint discovery
# ------------------------------------------------------------------------------------------

def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (temp dirs start with '.' and are ignored), oldest first.

    A checkpoint counts only once its ``trainer_state/state.json`` exists: that file is written last,
    inside the temp dir, before the rename, so a job killed at any instant leaves either a complete
    ``step-N/`` or a ``.step-N.tmp`` that is never picked up."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (p / "trainer_state" / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)
