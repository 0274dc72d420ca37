"""Question files in MT-bench format: one JSON object per line with ``question_id``, ``category``
(optional) and ``turns`` (user messages; turn 2 is asked after the model's own answer to turn 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_questions(path: str | Path, max_questions: int | None = None,
                   per_category: int | None = None) -> list[dict[str, Any]]:
    """Read and validate a question file; errors name the file, line and field.

    ``per_category`` keeps the first N questions of every category (file order), so a small run still
    covers all categories (MT-bench files are sorted by category); ``max_questions`` caps the total after it.
    """
    if per_category is not None and int(per_category) < 1:
        raise ValueError(f"per_category must be a positive number of questions, found {per_category}")
    if max_questions is not None and int(max_questions) < 1:
        raise ValueError(f"max_questions must be a positive number of questions (or null: all), found {max_questions}")
    seen: dict[str, int] = {}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{ln}: expected a JSON object, found {type(rec).__name__}")
            turns = rec.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise ValueError(f"{path}:{ln}: field 'turns' must be a non-empty list of non-empty strings, "
                                 f"found {type(turns).__name__ if not isinstance(turns, list) else turns[:2]!r}")
            qid = rec.get("question_id", f"line-{ln}")
            cat = str(rec.get("category") or "default")
            if per_category is not None and seen.get(cat, 0) >= int(per_category):
                continue
            seen[cat] = seen.get(cat, 0) + 1
            out.append({"question_id": qid, "category": cat, "turns": turns,
                        "system": rec.get("system")})
            if max_questions is not None and len(out) >= max_questions:
                break
    if not out:
        raise ValueError(f"question file {path} holds no questions{_why_empty(Path(path))}")
    return out


def _why_empty(path: Path) -> str:
    """The cause when ``path`` is a prepared data cache's held-out questions (its stats.json lies beside it)."""
    try:
        stats = json.loads((path.parent / "stats.json").read_text())
        cfg, split = stats["config"], stats["split"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return (f": it is the held-out split of data {cfg.get('name')!r}, which is empty (data.heldout_fraction="
            f"{cfg.get('heldout_fraction')} of {split.get('train_conversations', 0) + split.get('heldout_conversations', 0)}"
            f" conversations, data.max_conversations={cfg.get('max_conversations')}); raise data.heldout_fraction or "
            f"data.max_conversations, or pass questions=<a question file>")


def check_eval_limits(cfg: Any, target: Any) -> None:
    """Refuse eval settings that would report a meaningless τ, and bound prompts by the target's context.

    ``max_new_tokens=0`` reported τ 0.000 and ``max_questions=0`` evaluated one question: both are errors.
    A prompt as long as the target's context decodes nothing and also reported τ 0.000, so the prompt limit
    is capped at the context minus one (with a warning when ``max_prompt_tokens`` asked for more, or is
    null): longer prompts are then skipped and counted like any other over-long prompt."""
    import logging

    from draftheads.heads.job import config_int

    config_int(cfg, "max_new_tokens", None, 1)
    config_int(cfg, "max_turns", None, 1)
    config_int(cfg, "max_questions", None, 1)
    if "sweep" in cfg and cfg.sweep is not None:
        config_int(cfg.sweep, "max_questions", None, 1, "sweep")
        config_int(cfg.sweep, "max_new_tokens", None, 1, "sweep")
    limit = config_int(cfg, "max_prompt_tokens", None, 1)
    context = getattr(target.config, "max_position_embeddings", None)
    if context is None or (limit is not None and limit < int(context)):
        return
    logging.getLogger(__name__).warning(
        "max_prompt_tokens=%s is not below the target's context of %d tokens (max_position_embeddings of %r): "
        "a prompt that long leaves no room to decode; prompts over %d tokens are skipped and counted",
        limit, int(context), target.identity.name, int(context) - 1)
    cfg.max_prompt_tokens = int(context) - 1
