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
        raise ValueError(f"question file {path} holds no questions")
    return out
