"""tree=auto's knobs: which of a drafter's tree (or chain) knobs are free to choose, their validation, and the
fixed family defaults that fill what is neither set nor chosen.

Apart from the choice (eval/autotree.py) because every entry point reads these rules, with or without choosing:
the pipeline fills defaults, eval/measure.py asks each method's shape (eval/shapes.py).
"""

from __future__ import annotations

from typing import Any

from draftheads.heads import registry

DEFAULTS = {"size": 64, "top_k": 10, "depth": 6, "nodes": 60, "lookup_tokens": 10, "draft_tokens": 4, "lookup_branch": 0}
MINIMUM = {"size": 2, "top_k": 1, "depth": 1, "nodes": 1, "max_depth": 1, "lookup_tokens": 1, "draft_tokens": 1,
           "lookup_branch": 0}
SELECT = ("auto", "default")


def explicit_knob(d: dict[str, Any], key: str, where: str) -> int | None:
    """An explicitly set knob as an int (None when unset); 0, negatives and non-integers are errors."""
    v = d.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer() \
        or isinstance(v, str) and v.strip().lstrip("-").isdigit()
    if not ok:
        raise ValueError(f"{where}.{key}={v!r}: expected an integer >= {MINIMUM[key]} (or null: chosen by tree.select)")
    n = int(float(v))
    if n < MINIMUM[key]:
        raise ValueError(f"{where}.{key}={v!r}: must be >= {MINIMUM[key]} (or null: chosen by tree.select)")
    return n


def _select(tree: dict[str, Any]) -> str:
    s = tree.get("select") or "auto"
    if s not in SELECT:
        raise ValueError(f"tree.select={s!r}: expected one of {SELECT}")
    return s


def free_knobs(kind: str, tree: dict[str, Any], baselines: dict[str, Any]) -> list[str]:
    """The knobs tree=auto would choose for ``kind`` (null in the config; [] under tree.select=default): its
    shape's own (eval/shapes.py), and ``lookup_branch`` for drafters that draft trees."""
    validate(kind, tree, baselines)
    if _select(tree) != "auto":
        return []
    shape = registry.shape_of(kind)
    branch = ["lookup_branch"] if shape.branchable and tree.get("lookup_branch") is None else []
    return shape.free(tree, baselines) + branch


def validate(kind: str, tree: dict[str, Any], baselines: dict[str, Any]) -> None:
    _select(tree)
    for k in ("size", "top_k", "depth", "nodes", "max_depth", "lookup_branch"):
        explicit_knob(tree, k, "tree")
    for k in ("lookup_tokens", "draft_tokens"):
        explicit_knob(baselines, k, "baselines")


def fill_defaults(kind: str, tree: dict[str, Any], baselines: dict[str, Any],
                  chosen: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Concrete copies of ``tree`` / ``baselines``: explicit values kept, ``chosen`` next, family defaults last."""
    validate(kind, tree, baselines)
    tree, baselines, chosen = dict(tree), dict(baselines), dict(chosen or {})
    for k in ("size", "top_k", "depth", "nodes", "lookup_branch"):
        if tree.get(k) is None:
            tree[k] = chosen.get(k, DEFAULTS[k])
    if chosen.get("paths") is not None:
        tree["paths"] = chosen["paths"]
    for k in ("lookup_tokens", "draft_tokens"):
        if baselines.get(k) is None:
            baselines[k] = chosen.get(k, DEFAULTS[k])
    return tree, baselines
