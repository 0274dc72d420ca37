"""The family registry: one entry per draft family, naming where each of its parts lives.

Why a registry of import paths: a family is a plugin — its head module in ``heads/``, its trainer entry in
``train/``, its drafter in ``eval/`` — and code that serves every family (the eval drafter factory, measure's
sweeps, publish, the ``draftheads`` command) looks the family up here instead of branching on its name. The
parts are named as ``"module:attribute"`` strings and imported only when used, so ``heads/`` (the bottom
layer) depends on neither ``train/`` nor ``eval/``. Adding a family = its own files + one ``register`` call.
A family's *shape* (eval/shapes.py) tells tree=auto, sweeps and reports what it drafts; the baselines (prompt
lookup, a draft model, the untrained-head reference) register a builder and a shape the same way.
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
    shape: str  # "module:attr" of its draft shape (eval/shapes.py: what it proposes each step, how tree=auto sizes it)
    summary: str  # one line for help texts
    title: str = ""  # what a model card calls a published head ("EAGLE-3 draft"); the name when empty
    exporter: str = ""  # module with FORMATS and export_job(cfg, target, out, dtype, verifier) (scripts/export.py)

    def load(self, part: str) -> Any:
        """The object behind ``head``, ``drafter``, ``shape`` or ``exporter`` (a module), imported now."""
        spec = getattr(self, part)
        return _load(spec) if ":" in spec else importlib.import_module(spec)


@dataclass(frozen=True)
class Baseline:
    """A drafter the eval jobs run that is not a trained family: prompt lookup, a draft model, the untrained-head
    reference. It goes through the same interface as the families: a builder and a shape."""

    name: str  # the method name in eval/measure.py's ``methods`` and eval/acceptance.py's ``drafter``
    drafter: str  # "module:function"(target, head_dir, tree_cfg, dtype, baselines, num_heads, shared)
    #               -> (drafter, desc); ``shared``: a per-job dict for what is costly to rebuild (a loaded LM)
    shape: str  # "module:attr" of its draft shape
    summary: str

    def load(self, part: str) -> Any:
        return _load(getattr(self, part))


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


FAMILIES: dict[str, Family] = {}
BASELINES: dict[str, Baseline] = {}


def register(family: Family) -> Family:
    assert family.name not in FAMILIES and family.name not in BASELINES, f"{family.name!r} registered twice"
    assert ":" in family.shape, family.shape
    FAMILIES[family.name] = family
    return family


def register_baseline(baseline: Baseline) -> Baseline:
    assert baseline.name not in FAMILIES and baseline.name not in BASELINES, f"{baseline.name!r} registered twice"
    BASELINES[baseline.name] = baseline
    return baseline


def get(name: str) -> Family:
    """The registered family ``name``; ValueError naming the allowed ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown draft family {name!r}; registered: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def shape_of(kind: str) -> Any:
    """The draft shape (eval/shapes.py) of a family or baseline; the no-draft shape for anything else (plain)."""
    entry = FAMILIES.get(kind) or BASELINES.get(kind)
    return entry.load("shape") if entry else _load("draftheads.eval.shapes:NONE")


SHAPES = "draftheads.eval.shapes"
register(Family("medusa", "draftheads.heads.medusa:MedusaHeads", "draftheads.eval.drafters:build_medusa_drafter",
                "draftheads.train.medusa", f"{SHAPES}:STATIC",
                "Medusa heads: one head per future position, a static tree", "Medusa heads"))
register(Family("eagle", "draftheads.heads.eagle:EagleDraft", "draftheads.eval.eagle_drafter:build_eagle_drafter",
                "draftheads.train.eagle", f"{SHAPES}:DYNAMIC", "EAGLE: a one-layer feature draft, dynamic tree",
                "EAGLE draft"))
register(Family("eagle3", "draftheads.heads.eagle3:Eagle3Draft", "draftheads.eval.eagle3_drafter:build_eagle3_drafter",
                "draftheads.train.eagle3", f"{SHAPES}:DYNAMIC",
                "EAGLE-3: fused low/mid/high features, training-time test, draft vocabulary", "EAGLE-3 draft",
                exporter="draftheads.scripts.export"))
register(Family("block", "draftheads.heads.block:BlockDraft", "draftheads.eval.block_drafter:build_block_drafter",
                "draftheads.train.block", "draftheads.eval.block_shape:SHAPE",
                "Block draft (DFlash-style): a few layers draft a whole block in one forward", "Block draft",
                exporter="draftheads.heads.block_export"))
register_baseline(Baseline("prompt_lookup", "draftheads.eval.baselines:build_prompt_lookup", f"{SHAPES}:LOOKUP",
                           "prompt lookup: copy the continuation of the last n-gram seen earlier"))
register_baseline(Baseline("draft_model", "draftheads.eval.baselines:build_draft_model", f"{SHAPES}:DRAFT_MODEL",
                           "a small causal LM (baselines.draft_model) drafting a chain"))
register_baseline(Baseline("medusa-init", "draftheads.eval.drafters:build_untrained_medusa", f"{SHAPES}:STATIC",
                           "identity-initialized Medusa heads: the untrained reference"))
