"""The family registry: every family's parts resolve, and code serving all families asks it instead of names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from draftheads.heads import registry

REPO = Path(__file__).resolve().parents[1]


def test_every_family_part_resolves() -> None:
    assert set(registry.FAMILIES) == {"medusa", "eagle", "eagle3"}
    for fam in registry.FAMILIES.values():
        assert callable(fam.load("head").from_pretrained) and callable(fam.load("drafter"))
        assert (REPO / (fam.trainer.removeprefix("draftheads.").replace(".", "/") + ".py")).is_file()
    assert registry.get("medusa").tree == "static" and registry.get("eagle3").tree == "dynamic"


def test_unknown_family_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown draft family 'gpt'; registered: medusa, eagle, eagle3"):
        registry.get("gpt")


def test_a_new_family_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered family is reachable from the eval factory, sweeps and tree=auto without touching them."""
    from draftheads.eval import autotree_knobs, drafters

    monkeypatch.setitem(registry.FAMILIES, "toy", registry.Family(
        "toy", "draftheads.heads.eagle:EagleDraft", "tests.test_registry:_toy_drafter", "draftheads.train.eagle", "dynamic", "a toy"))
    assert drafters.build_drafter("toy", None, "dir", {}, None) == ("drafter", {"drafter": "toy", "head": "dir"})
    assert autotree_knobs.family_of("toy") == "dynamic"


def _toy_drafter(target, head, tree_cfg, dtype, allow_target_mismatch=False):
    return "drafter", {"drafter": "toy", "head": head}


SHARED = ["eval/drafters.py", "eval/measure.py", "eval/measure_methods.py", "eval/measure_run.py",
          "eval/measure_summary.py", "eval/autotree.py", "eval/autotree_knobs.py", "eval/autotree_model.py",
          "eval/acceptance.py", "scripts/publish.py", "draftheads/cli.py", "pipeline/tau_eval.py",
          "pipeline/eval_after.py"]


@pytest.mark.parametrize("path", SHARED)
def test_shared_code_does_not_branch_on_a_family_name(path: str) -> None:
    """No `x == "eagle3"` / `x in ("medusa", ...)` comparisons in code that serves every family."""
    names = set(registry.FAMILIES)
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.Compare):
            consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            assert not consts, f"{path}:{node.lineno} compares against family name {consts[0].value!r}"
