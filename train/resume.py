"""What ``train.resume=true`` checks before it trusts a checkpoint, so a resume never silently starts over,
continues on other data, or dies on a raw zip error.

- :func:`pick_checkpoint`: the newest *complete* ``step-N/`` (head files, ``trainer_state/state.json``,
  readable optimizer/scheduler archives); newer incomplete ones are named in a warning. Step directories
  that exist but are all incomplete stop the run naming each file, instead of starting from step 0.
- :func:`check_same_data`: the data identity recorded in the checkpoint (prepared-data cache key: source file
  identity, tokenizer, data settings) must match this run's, unless ``train.resume_allow_data_change=true``.
- :func:`explain_state_mismatch`: a head whose shapes differ from the checkpoint's names the config keys that
  differ (``head.num_heads=3 here, 2 in the checkpoint``) instead of "Missing key(s) in state_dict".
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dirs(out_dir: Path) -> list[tuple[int, Path]]:
    """Every ``checkpoints/step-N`` directory (complete or not), oldest first; temp dirs start with '.'."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir())


def _archive_problem(path: Path) -> str | None:
    """torch.save writes a zip; a truncated one has no central directory (checked without loading it)."""
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        return f"{path} is unreadable or truncated ({e})"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from (None: it can), naming the file."""
    ts = path / "trainer_state"
    if not ts.is_dir():
        return f"{path} has no trainer_state/ (a head-only copy: it loads for eval, but training cannot resume from it)"
    state = ts / "state.json"
    if not state.is_file():
        return f"{state} is missing (the checkpoint was not finished)"
    try:
        json.loads(state.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"{state} is not valid JSON ({e})"
    if not (path / "model.safetensors").is_file():
        return f"{path / 'model.safetensors'} is missing"
    if not (ts / "deepspeed").is_dir():  # DeepSpeed keeps its optimizer shards in its own layout
        for name in ("optimizer.pt", "scheduler.pt"):
            f = ts / name
            if not f.is_file():
                return f"{f} is missing"
            problem = _archive_problem(f)
            if problem:
                return problem
    return None


def pick_checkpoint(out_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint; None when there is no step directory at all."""
    dirs = step_dirs(out_dir)
    skipped: list[str] = []
    for step, path in reversed(dirs):
        problem = checkpoint_problem(path)
        if problem is None:
            if skipped:
                log.warning("resuming from %s, the newest complete checkpoint; skipped newer incomplete ones: %s",
                            path, "; ".join(skipped))
            return step, path
        skipped.append(problem)
    if skipped:
        raise ValueError(f"train.resume=true but no checkpoint in {Path(out_dir) / 'checkpoints'} can be resumed: "
                         + "; ".join(skipped) + ". Delete them or use train.resume=false with a new out_dir")
    return None


def trim_metrics(metrics_path: Path, step: int) -> None:
    """Drop metrics rows past ``step`` (all of them when starting over), so a resumed or restarted run never
    appends a second copy of the same steps."""
    from draftheads.heads.checkpoint import atomic_write_text

    if not metrics_path.is_file():
        return
    text = metrics_path.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
    kept = "\n".join(lines) + ("\n" if lines else "")
    if kept != text:  # untouched when nothing goes (resuming a finished run leaves its files as they were)
        atomic_write_text(metrics_path, kept)


def saved_data_identity(path: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """The data identity a checkpoint was trained on: trainer_state/state.json, else the head's config.json."""
    if state.get("data"):
        return state["data"]
    try:
        return json.loads((path / "config.json").read_text()).get("data")
    except (OSError, json.JSONDecodeError):
        return None


def check_same_data(path: Path, state: dict[str, Any], current: dict[str, Any] | None, cfg: Any) -> None:
    """Refuse to continue a run on other data (its data position would index a different dataset)."""
    saved = saved_data_identity(path, state)
    if not saved or not current or saved.get("key") is None or current.get("key") is None:
        return
    if saved.get("key") == current.get("key"):
        return
    what = (f"{path} was trained on data {saved.get('name')!r} (prepared-data key {saved.get('key')}, rows "
            f"{saved.get('rows')}), this run prepares {current.get('name')!r} (key {current.get('key')}, rows "
            f"{current.get('rows')})")
    if bool(cfg.train.get("resume_allow_data_change", False)):
        log.warning("resuming on different data (train.resume_allow_data_change=true): %s", what)
        return
    raise ValueError(f"cannot resume: {what}. The data position would index a different dataset; resume with the "
                     f"same data settings and file, or set train.resume_allow_data_change=true to continue anyway")


def explain_state_mismatch(path: Path, cfg: Any, err: Exception) -> ValueError:
    """A ValueError naming the ``head.*`` settings that differ from the checkpoint's (shapes that do not load)."""
    try:
        saved = json.loads((path / "config.json").read_text()).get("head_config", {})
    except (OSError, json.JSONDecodeError):
        saved = {}
    head = cfg.get("head") or {}
    diffs = [f"head.{k}={head[k]} here but {saved[k]} in the checkpoint" for k in head
             if k in saved and head[k] is not None and head[k] != saved[k]]
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    detail = "; ".join(diffs) if diffs else f"its weights do not fit this run's draft ({first[:300]})"
    return ValueError(f"cannot resume from {path}: {detail}. Resume with the checkpoint's settings "
                      f"({path / 'config.json'}), or train.resume=false with a new out_dir")
