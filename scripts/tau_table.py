"""The τ table of a published head's model card: which eval results belong to the weights being published.

Why apart from publish.py: matching a result to a head (same folder, or the same ``model.safetensors`` bytes) and
turning eval/acceptance.py and eval/measure.py results into card rows is its own concern, tested on its own.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any


def file_sha256(path: Path) -> str:
    """The file's digest, hashed once per (file, size, mtime): a card checks one checkpoint against many results."""
    st = path.stat()
    return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def with_branch(tree: Any, desc: dict[str, Any]) -> Any:
    """``tree`` + ' + lookup branch N' when the head decoded with a prompt-lookup branch (tree.lookup_branch)."""
    n = desc.get("lookup_branch")
    return f"{tree} + lookup branch {n}" if n else tree


def same_head(path: str | None, ckpt: Path | None) -> bool:
    """Whether a result's head folder holds the weights being published: the same folder, or a copy of its
    ``model.safetensors`` (a run's ``final/`` and ``best/`` are different heads unless their bytes agree)."""
    if ckpt is None:
        return True
    if not path:
        return False
    p = Path(path)
    if p.resolve() == ckpt.resolve():
        return True
    a, b = p / "model.safetensors", ckpt / "model.safetensors"
    return a.is_file() and b.is_file() and file_sha256(a) == file_sha256(b)


def measure_rows(r: dict[str, Any], ckpt: Path | None = None) -> list[dict[str, Any]]:
    """Rows of an eval/measure.py ``results.json``: the greedy setting of every trained head, or only of the head
    ``ckpt`` holds (a run measuring several heads must not lend the card another head's figures)."""
    rows = []
    for name, m in r["methods"].items():
        if not m.get("checkpoint") or not same_head(m["checkpoint"], ckpt):
            continue
        for block in r["settings"].values():
            if block.get("mode") != "greedy" or name not in block.get("methods", {}):
                continue
            s = block["methods"][name]
            rows.append({"questions": Path(str(r.get("questions", "?"))).name, "num_questions": r.get("num_questions"),
                         "turns": s.get("turns"), "drafter": m.get("drafter") or m.get("kind"),
                         "tree": with_branch(f"{m.get('tree_kind')} ({m.get('tree_select')}, "
                                              f"{m.get('tree_size')} verified)", m),
                         "tree_size": m.get("tree_size"), "mode": "greedy", "dtype": r.get("dtype"),
                         "max_new_tokens": r.get("max_new_tokens"), "tau": s.get("tau"),
                         "tokens_per_s": s.get("tokens_per_s"),
                         "speedup_vs_plain": (block.get("speedup_vs_plain") or {}).get(name, {}).get("overall"),
                         "accept_at_depth": None, "source": "eval/measure.py",
                         "per_category": {c: v.get("tau") for c, v in (s.get("per_category") or {}).items()}})
    return rows


def tau_rows(eval_files: list[Path], ckpt: Path | None = None, optional: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """One row per eval/acceptance.py result (question set, drafter, τ, tokens/s, acceptance by depth), and one per
    trained head of an eval/measure.py results.json. With ``ckpt``, only results measured on that head's weights:
    a given file that measured none is a user error; one in ``optional`` (the run's own eval.json, which
    measured ``final/``) is skipped with a note."""
    rows = []
    for f in eval_files:
        r = read_json(f)
        if r is not None and "settings" in r and "methods" in r:
            got = measure_rows(r, ckpt)
            heads = [m.get("checkpoint") for m in r["methods"].values() if m.get("checkpoint")]
        elif r is None or "summary" not in r:
            raise ValueError(f"{f} is neither an eval/acceptance.py result (no 'summary') nor an eval/measure.py "
                             f"results.json")
        else:
            heads = [(r.get("drafter") or {}).get("head")]
            got = [_acceptance_row(r)] if same_head(heads[0], ckpt) else []
        if not got and ckpt is not None:
            msg = f"{f} measured {heads}, not the checkpoint being published ({ckpt})"
            if f not in optional:
                raise ValueError(f"{msg}: give eval= results measured on checkpoint={ckpt}")
            print(f"note: {msg}; its τ is left off the card")
        rows += got
    return rows


def _acceptance_row(r: dict[str, Any]) -> dict[str, Any]:
    """The card's row for one eval/acceptance.py result."""
    s, d = r["summary"], r.get("drafter", {})
    kind = d.get("tree_source") or d.get("tree_kind") or d.get("tree")
    tree = with_branch(f"{kind} ({d['tree_size']} verified)" if d.get("tree_size") else kind, d)
    return {"questions": Path(str(r.get("questions", "?"))).name, "num_questions": r.get("num_questions"),
            "turns": s.get("turns"), "drafter": d.get("drafter"), "tree": tree,
            "tree_size": d.get("tree_size"), "mode": r.get("mode"), "dtype": r.get("dtype"),
            "max_new_tokens": r.get("max_new_tokens"), "tau": s.get("tau"),
            "tokens_per_s": s.get("tokens_per_s"), "speedup_vs_plain": r.get("speedup_vs_plain"),
            "accept_at_depth": s.get("accept_at_depth"),
            "per_category": {c: v.get("tau") for c, v in (s.get("per_category") or {}).items()}}
