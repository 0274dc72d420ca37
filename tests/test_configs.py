"""Every shipped Hydra config composes, and every field carries a one-line comment."""

from __future__ import annotations

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
    cfg = compose(name, [])
    assert cfg is not None


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
