"""Every shipped Hydra config composes, and every field carries a one-line comment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import CONF, compose

PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml"))
GROUPS = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONF.iterdir()
          if d.is_dir() and d.name not in ("launch", "experiment")}
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _defaults(name: str) -> list:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text()).get("defaults", [])


def _groups_of(name: str) -> list[str]:
    return [next(iter(d)) for d in _defaults(name) if isinstance(d, dict)]


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_config_composes(name):
    """The composed job config holds every group its defaults list and every key its file sets, and a plain value
    written in the file is the composed value (no group or schema overrode it)."""
    from omegaconf import OmegaConf

    cfg = compose(name, [])
    own = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    keys = set(own) - {"defaults", "hydra"}
    groups = {g for g in _groups_of(name) if g in GROUPS}
    assert keys and keys | groups <= set(cfg), sorted((keys | groups) - set(cfg))
    for k in keys:
        v = own[k]
        if v == "???":
            assert OmegaConf.is_missing(cfg, k), k
        elif v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and "${" not in v):
            assert cfg[k] == v, (k, cfg[k], v)


CASES = [(p, g, o) for p in PRIMARY for g in _groups_of(p) if g in GROUPS for o in GROUPS[g]]


@pytest.mark.parametrize("primary,group,option", CASES)
def test_every_group_option_composes(primary, group, option):
    overrides = [f"{group}={option}"]
    if option in ("hf",):
        overrides.append("target.name=/some/local/model")
    if option == "file":
        overrides.append("data.path=/some/file.jsonl")
    cfg = compose(primary, overrides)
    assert group in cfg


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_configs_compose(name):
    primary = name.split("_")[0]  # medusa_full -> medusa.yaml
    cfg = compose(primary, [f"+experiment={name}"])
    assert cfg.run_name


def _yaml_files() -> list[Path]:
    return sorted(p for p in CONF.rglob("*.yaml") if p.parent.name != "launch" or p.suffix == ".yaml")


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(CONF)))
def test_every_field_has_a_comment(path):
    """Convention: each config field has a one-line comment (on its line or the line above)."""
    lines = path.read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("- ") or s.endswith(":") and "#" not in s:
            continue  # comments, list items, section headers
        if ":" in s and "#" not in s and not (i > 0 and lines[i - 1].strip().startswith("#")):
            missing.append(f"{i + 1}: {s}")
    assert not missing, f"{path}: fields without a comment:\n" + "\n".join(missing)


@pytest.mark.parametrize("name,out,expected", [("features", "runs/x/cache", "runs/x/cache/hydra"),
                                               ("distill", "runs/x/d.jsonl", "runs/x/d.jsonl.hydra")])
def test_hydra_logs_follow_the_output(name, out, expected):
    """A job given out=... keeps Hydra's logs with its output instead of a fixed runs/<job>/hydra."""
    from hydra import compose as hcompose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = hcompose(config_name=name, overrides=[f"out={out}"], return_hydra_config=True)
    assert cfg.hydra.run.dir == expected


# --------------------------------------------------------------------------- typed schemas (heads/schema.py)

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from draftheads.heads.schema import SCHEMAS  # noqa: E402


def _dotted(node, prefix: str = "", schema: bool = False) -> set[str]:
    """Dotted keys of a mapping; in a schema, a mapping left open (Dict[str, Any]) counts as one leaf."""
    out = set()
    for k in node.keys():
        if k == "defaults":
            continue
        v = node._get_node(k) if isinstance(node, DictConfig) else node[k]  # a '???' value is not read
        key = prefix + k
        out.add(key)
        if isinstance(v, (dict, DictConfig)) and not (schema and OmegaConf.get_type(v) is dict):
            out |= _dotted(v, key + ".", schema)
    return out


SCHEMA_FILES = [(g, p) for g in SCHEMAS for p in sorted((CONF / g).glob("*.yaml"))
                if "- schema" in p.read_text()]


def test_every_schema_group_has_a_file_that_uses_it():
    assert {g for g, _ in SCHEMA_FILES} == set(SCHEMAS)


@pytest.mark.parametrize("group,path", SCHEMA_FILES, ids=lambda x: str(x) if isinstance(x, str) else x.name)
def test_schema_and_yaml_name_the_same_fields(group, path):
    """No drift: every schema field has its documented YAML line and every YAML key a typed field."""
    schema = OmegaConf.structured(SCHEMAS[group])
    fields = _dotted(schema, schema=True)
    open_maps = {k for k in fields if OmegaConf.get_type(OmegaConf.select(schema, k)) is dict}
    yaml_keys = {k for k in _dotted(OmegaConf.load(path)) if not any(k.startswith(m + ".") for m in open_maps)}
    assert yaml_keys == fields, sorted(yaml_keys ^ fields)


@pytest.mark.parametrize("primary,override,key", [
    ("eagle3", "train.max_steps=abc", "train.max_steps"),
    ("medusa", "optim.lr=fast", "optim.lr"),
    ("eval", "tree.nodes=1.5", "tree.nodes"),
    ("measure", "baselines.lookup_tokens=many", "baselines.lookup_tokens"),
    ("prepare", "data.heldout_fraction=some", "data.heldout_fraction"),
    ("eval", "target.trust_remote_code=maybe", "target.trust_remote_code"),
])
def test_a_wrongly_typed_value_stops_composition_naming_the_key(primary, override, key):
    """Found at compose time, before a target loads (was: after, or never)."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose(primary, [override])
    assert key in str(e.value.__cause__ or e.value)


@pytest.mark.parametrize("primary,override,allowed", [
    ("eagle3", "train.mixed_precision=fp8", "auto, no, bf16, fp16"),
    ("eval", "tree.select=best", "auto, default"),
    ("measure", "tree.kind=CHAIN", "auto, static, dynamic, chain"),
    ("medusa", "optim.schedule=step", "cosine, linear, constant"),
    ("prepare", "data.on_error=ignore", "skip, raise"),
])
def test_a_value_outside_its_choices_is_named_before_the_job_runs(primary, override, allowed):
    from draftheads.heads.schema import check

    with pytest.raises(ValueError, match=re.escape(f"{override} is not allowed; allowed: {allowed}")):
        check(compose(primary, [override]))
    check(compose(primary, ["train.shard_target=true"] if primary in ("eagle3", "medusa") else []))  # defaults pass
