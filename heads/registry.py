"""The family registry: one entry per draft family, naming where each of its parts lives.

Why a registry of import paths: a family is a plugin — its head module in ``heads/``, its trainer entry in
``train/``, its drafter in ``eval/`` — and code that serves every family (the eval drafter factory, measure's
sweeps, publish, the ``draftheads`` command) looks the family up here instead of branching on its name. The
parts are named as ``"module:attribute"`` strings and imported only when used, so ``heads/`` (the bottom
layer) depends on neither ``train/`` nor ``eval/``. Adding a family = its own files + one ``register`` call.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # the checkpoint's config.json "family"
    head: str  # "module:Class" with from_pretrained(path, target, allow_target_mismatch=False)
    drafter: str  # "module:function"(target, head_dir, tree_cfg, dtype, allow_target_mismatch) -> (drafter, desc)
    trainer: str  # entry module run by `draftheads train <name>` / accelerate launch
    tree: str  # "static" (fixed paths over per-position candidates; sized by tree.size, root included) or
    #            "dynamic" (EAGLE-2 expansion; sized by tree.nodes drafted, plus top_k and depth)
    summary: str  # one line for help texts

    def load(self, part: str) -> Any:
        """The object behind ``head`` or ``drafter``, imported now."""
        module, _, attr = getattr(self, part).partition(":")
        return getattr(importlib.import_module(module), attr)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    assert family.name not in FAMILIES, f"family {family.name!r} registered twice"
    assert family.tree in ("static", "dynamic"), family.tree
    FAMILIES[family.name] = family
    return family


def get(name: str) -> Family:
    """The registered family ``name``; ValueError naming the allowed ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown draft family {name!r}; registered: {', '.join(FAMILIES)}")
    return FAMILIES[name]


register(Family("medusa", "draftheads.heads.medusa:MedusaHeads", "draftheads.eval.drafters:build_medusa_drafter", "draftheads.train.medusa", "static",
                "Medusa heads: one head per future position, a static tree"))
register(Family("eagle", "draftheads.heads.eagle:EagleDraft", "draftheads.eval.eagle_drafter:build_eagle_drafter", "draftheads.train.eagle", "dynamic",
                "EAGLE: a one-layer feature draft, dynamic tree"))
register(Family("eagle3", "draftheads.heads.eagle3:Eagle3Draft", "draftheads.eval.eagle3_drafter:build_eagle3_drafter", "draftheads.train.eagle3",
                "dynamic", "EAGLE-3: fused low/mid/high features, training-time test, draft vocabulary"))
