"""What eval/measure.py compares: the methods (built-in decoders and trained heads), the decoding settings every
method runs under, and each method's drafter at a size (a sweep point, or the tree that tree=auto chooses).

Apart from the job because this is configuration turned into drafters: nothing here decodes or times anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from draftheads.eval.autotree import configure
from draftheads.eval.autotree_model import MAX_WIDTH
from draftheads.eval.calibration import Calibration, heldout_calibration
from draftheads.eval.drafters import build_drafter, checkpoint_family
from draftheads.eval.latency import cached_latency_profile
from draftheads.heads import registry
from draftheads.heads.target import FrozenTarget

HF_KINDS = ("hf_plain", "hf_prompt_lookup")  # transformers' own generate(): the off-the-shelf peers
BUILTIN = ("plain",) + HF_KINDS + tuple(registry.BASELINES)  # methods named without a checkpoint


@dataclass
class Method:
    """One column of the comparison: a name, how it decodes, and (for trained heads) its checkpoint."""

    name: str
    kind: str  # plain | hf_plain | hf_prompt_lookup | a registered baseline or family (heads/registry.py)
    checkpoint: str | None = None
    size: int | None = None  # sweep point: tree size / chain length + 1 (None = configured default)
    drafter: Any = None
    desc: dict[str, Any] = field(default_factory=dict)
    choice: dict[str, Any] = field(default_factory=dict)  # tree=auto's report (empty when nothing was chosen)

    @property
    def label(self) -> str:
        return self.name if self.size is None else f"{self.name}@{self.size}"


@dataclass
class Setting:
    """A decoding setting every method is run under."""

    name: str  # "greedy", "T=0.7", ...
    mode: str  # greedy | exact | typical
    sampling: dict[str, Any] | None  # {temperature, top_p, top_k}; None for greedy


# --------------------------------------------------------------------------------------------
# Configuration → methods and settings
# --------------------------------------------------------------------------------------------

def resolve_methods(cfg: DictConfig) -> list[Method]:
    """Built-in method names from ``methods`` plus every entry of ``heads``; plain is always included."""
    heads = {str(k): str(v) for k, v in (cfg.get("heads") or {}).items()}
    names = [str(m) for m in (cfg.methods or [])]
    names += [h for h in heads if h not in names]
    if "plain" not in names:
        names.insert(0, "plain")  # speedups are relative to it
    if len(set(names)) != len(names):
        raise ValueError(f"methods must be unique, got {names}")
    out = []
    for n in names:
        if n in heads:
            out.append(Method(n, checkpoint_family(heads[n]), heads[n]))
        elif n in BUILTIN:
            out.append(Method(n, n))
        else:
            raise ValueError(f"unknown method {n!r}: expected one of {BUILTIN} or a label in heads {sorted(heads)}")
    return out


def decoding_settings(cfg: DictConfig) -> list[Setting]:
    out = [Setting("greedy", "greedy", None)] if cfg.greedy else []
    if cfg.sample_mode not in ("exact", "typical"):
        raise ValueError(f"sample_mode must be exact or typical, got {cfg.sample_mode!r}")
    for t in cfg.temperatures or []:
        if float(t) <= 0:
            raise ValueError(f"temperatures must be > 0 (greedy is its own setting), got {t}")
        out.append(Setting(f"T={float(t):g}", str(cfg.sample_mode),
                           {"temperature": float(t), "top_p": float(cfg.top_p), "top_k": int(cfg.top_k)}))
    if not out:
        raise ValueError("nothing to measure: greedy=false and no temperatures")
    return out


def sweep_axis(kind: str) -> str | None:
    """Which sweep sizes a method takes (``sweep.tree_sizes`` or ``sweep.chain_sizes``); None: nothing to sweep.
    transformers' prompt lookup sweeps its chain like ours."""
    return "chain_sizes" if kind == HF_KINDS[1] else registry.shape_of(kind).sweep


def sized_configs(method: Method, cfg: DictConfig, size: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tree cfg, baselines cfg) for a method at a sweep size: the size maps onto the family's own knob.

    A sweep point fixes its size and takes the family defaults for the other knobs (tree.select=default):
    the sweep shows the size axis; tree=auto chooses only for the main run (size None)."""
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    base = OmegaConf.to_container(cfg.baselines, resolve=True)
    if size is not None:
        if size < 2:
            raise ValueError(f"sweep sizes count the root too and must be >= 2, got {size}")
        tree["select"] = "default"
        registry.shape_of(method.kind).apply_size(tree, base, size)  # e.g. tree.size, tree.nodes, lookup_tokens
    return tree, base


def _make_drafter(m: Method, target: FrozenTarget, cfg: DictConfig, tree: dict[str, Any], base: dict[str, Any],
                  shared: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """(drafter, description) for concrete tree/baselines configs; ``shared`` keeps what a drafter loads once per
    job (the draft LM) across sizes."""
    return build_drafter(m.kind, target, m.checkpoint, OmegaConf.create(tree), target.dtype,
                         bool(cfg.allow_target_mismatch), int(cfg.untrained_heads), base, shared)


def build_method(method: Method, target: FrozenTarget, cfg: DictConfig, size: int | None = None,
                 shared: dict[str, Any] | None = None, auto: "AutoContext | None" = None) -> Method:
    """Attach a drafter (None for transformers' generate) to a copy of ``method`` at ``size``.

    With ``auto`` (the main run), knobs left null are chosen by tree=auto (eval/autotree.py) on held-out
    calibration prompts; explicit ``tree.*`` / ``baselines.*`` values are kept."""
    m = Method(method.name, method.kind, method.checkpoint, size)
    if m.kind in HF_KINDS:
        m.desc = {"drafter": m.kind, "lookup_tokens": int(cfg.hf.lookup_tokens) if m.kind == "hf_prompt_lookup"
                  else None, "tree_size": 1 + int(cfg.hf.lookup_tokens) if m.kind == "hf_prompt_lookup" else 1}
        return m
    tree, base = sized_configs(m, cfg, size)
    if auto is None:
        tree["select"] = "default"
    make = lambda t, b: _make_drafter(m, target, cfg, t, b, shared)[0]  # noqa: E731
    tree, base, m.choice = configure(
        m.kind, target, tree, base, make, auto.calibration if auto else None, auto.profile if auto else None,
        m.checkpoint, int(cfg.untrained_heads), auto.eos if auto else ())
    m.drafter, m.desc = _make_drafter(m, target, cfg, tree, base, shared)
    if m.choice:
        m.desc = {**m.desc, "tree_select": "auto"}
        if "tree_source" in m.desc:
            m.desc["tree_source"] = "auto"
    return m


@dataclass
class AutoContext:
    """What tree=auto needs, computed once per job: the calibration split (lazily) and the latency profile."""

    cfg: DictConfig
    target: FrozenTarget
    qfile: Path
    questions: list[dict[str, Any]]
    profile_data: dict[str, Any]
    eos: set[int]
    calib: Calibration | None = None

    def calibration(self) -> Calibration:
        if self.calib is None:
            self.questions, self.calib = heldout_calibration(self.cfg, self.target, self.qfile, self.questions)
        return self.calib

    def profile(self) -> dict[str, Any]:
        """The job's profile when it reaches the widest tree considered, else the cached default one."""
        if max(p["width"] for p in self.profile_data["points"]) >= MAX_WIDTH:
            return self.profile_data
        return cached_latency_profile(self.target)

