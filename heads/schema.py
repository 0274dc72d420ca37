"""Typed schemas of the shared config groups, checked by Hydra when a job's config is composed.

Why: a wrong type (``train.max_steps=abc``, ``tree.nodes=1.5``) or a misspelled key should stop the job before
the target loads, naming the key; and the YAML and the code must not drift. Each group file in ``conf/`` lists
``schema`` first in its defaults, so Hydra merges the YAML onto the dataclass below and validates every value and
override against its type. The documentation of each field lives once, beside its default in ``conf/``
(``docs/configuration.md`` is generated from it); a test checks that every schema field has a YAML line and the
other way round. Family-specific groups (``head``) stay with their family; registering happens on import of
``heads`` (``heads/__init__.py``), so anything that composes a config imports this first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class DataConfig:
    """conf/data/*.yaml."""

    name: str = "sharegpt"
    source: str = "sharegpt"
    path: Optional[str] = None
    max_conversations: Optional[int] = None
    heldout_fraction: float = 0.02
    split_seed: int = 0
    split_by: str = "prompt"
    dedupe: bool = True
    max_length: int = 1024
    truncation: str = "truncate"
    packing: bool = False
    chat_template: Optional[str] = None
    on_error: str = "skip"
    cache_dir: Optional[str] = None
    first_turn_only: bool = False

    @classmethod
    def from_any(cls, cfg: Any) -> "DataConfig":
        """The runtime object from a composed ``data`` node (or a plain dict, as tests pass)."""
        if isinstance(cfg, cls):
            return cfg
        d = dict(cfg)
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown data config fields {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)


@dataclass
class TauEvalConfig:
    every: int = 0
    at_start: Optional[bool] = None
    evaluator: Dict[str, Any] = field(default_factory=dict)  # _target_ + its own keyword arguments


@dataclass
class TrainConfig:
    """conf/train/default.yaml."""

    seed: int = 0
    device: str = "auto"
    mixed_precision: str = "auto"
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 300
    group_by_length: bool = True
    log_every: int = 10
    save_every: int = 100
    keep_last: int = 2
    resume: bool = False
    overwrite: bool = False
    resume_allow_data_change: bool = False
    eval_every: int = 0
    eval_tokens: int = 20000
    sim_tau_examples: int = 16
    shard_target: str = "auto"
    eval_after: Dict[str, Any] = field(default_factory=dict)  # _target_, enabled + eval settings
    tau_eval: TauEvalConfig = field(default_factory=TauEvalConfig)


@dataclass
class OptimConfig:
    """conf/optim/*.yaml."""

    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: Optional[int] = 20
    warmup_ratio: float = 0.05
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0


@dataclass
class LoggingConfig:
    """conf/logging/*.yaml."""

    wandb: str = "offline"
    project: str = "draftheads"


@dataclass
class CalibrationConfig:
    questions: int = 8
    max_new_tokens: int = 64
    timing_tokens: int = 24


@dataclass
class TreeConfig:
    """conf/tree/*.yaml."""

    select: str = "auto"
    kind: str = "auto"
    top_k: Optional[int] = None
    depth: Optional[int] = None
    nodes: Optional[int] = None
    size: Optional[int] = None
    max_depth: Optional[int] = None
    tuned: bool = True
    paths: Optional[List[List[int]]] = None
    lookup_branch: Optional[int] = None
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


@dataclass
class BaselinesConfig:
    """conf/baselines/*.yaml."""

    draft_model: Optional[str] = None
    draft_tokens: Optional[int] = None
    local_files_only: bool = True
    lookup_tokens: Optional[int] = None
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1


@dataclass
class TargetConfig:
    """conf/target/*.yaml."""

    name: str = "???"
    revision: Optional[str] = None
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    local_files_only: bool = True


# Values a string field may take, checked by ``check`` before a job runs (a typed field cannot say this).
CHOICES: dict[str, tuple[str, ...]] = {
    "data.source": ("sharegpt", "file"), "data.split_by": ("prompt", "id"), "data.truncation": ("truncate", "drop"),
    "data.on_error": ("skip", "raise"),
    "target.dtype": ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"),
    "target.attn_implementation": ("sdpa", "eager", "flash_attention_2"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"), "train.shard_target": ("auto", "true", "false"),
    "optim.schedule": ("cosine", "linear", "constant"), "logging.wandb": ("offline", "online", "disabled"),
    "tree.select": ("auto", "default"), "tree.kind": ("auto", "static", "dynamic", "chain"),
}


# Numeric ranges a field must keep, checked by ``check`` with the choices: (lowest, highest, why). A learning rate
# of 0 trains nothing without a word, so it is refused like a negative one. Tree knobs are bounded by what one
# verification forward can carry: the target verifies nodes + 1 tokens at once (on a CPU a 64-token forward already
# costs ~3 one-token forwards) and an expansion of top_k² candidates per depth beyond these allocates without end.
RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "optim.lr": (0.0, None, "a learning rate must be > 0 (0 trains nothing; a negative one climbs the loss)"),
    "tree.top_k": (1, 64, "children per expanded node"),
    "tree.depth": (1, 32, "draft depth"),
    "tree.nodes": (1, 1024, "drafted nodes the target verifies in one forward"),
    "tree.size": (2, 1024, "tokens in one verification forward, root included"),
    "tree.max_depth": (1, 32, "depth cap"),
    "tree.lookup_branch": (0, 64, "prompt-lookup tokens merged into the tree"),
    "baselines.draft_tokens": (1, 64, "tokens a draft model proposes per step"),
    "baselines.lookup_tokens": (1, 64, "tokens prompt lookup proposes per step"),
}


def check(cfg: Any) -> None:
    """Raise ValueError naming the key, the value and what is allowed, for every ``CHOICES`` and ``RANGES`` key the
    config has (before any model loads)."""
    from omegaconf import OmegaConf

    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        text = str(value).lower() if key == "train.shard_target" else str(value)  # true/True/false/False
        if value is not None and text not in allowed:
            group = key.split(".")[0]
            raise ValueError(f"{key}={value} is not allowed; allowed: {', '.join(allowed)} (conf/{group}/)")
    for key, (low, high, why) in RANGES.items():
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # null: chosen later; a wrong type is the typed schema's message
        group = key.split(".")[0]
        if key == "optim.lr" and not value > 0:
            raise ValueError(f"{key}={value} is not allowed: {why} (conf/{group}/)")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"{key}={value} is out of range: {why} must be in [{low}, {high}] (conf/{group}/)")


SCHEMAS: dict[str, type] = {"data": DataConfig, "train": TrainConfig, "optim": OptimConfig,
                            "logging": LoggingConfig, "tree": TreeConfig, "baselines": BaselinesConfig,
                            "target": TargetConfig}


def register() -> None:
    """Store each schema as ``<group>/schema`` (idempotent)."""
    cs = ConfigStore.instance()
    for group, node in SCHEMAS.items():
        cs.store(group=group, name="schema", node=node)


register()
