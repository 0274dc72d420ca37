"""The family registry: every family's parts resolve, code serving all families asks it (and the family's shape)
instead of names, and a family registered from this file alone decodes through eval/measure.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from conftest import compose
from draftheads.eval import shapes
from draftheads.eval.generate import DraftTree
from draftheads.heads import registry

REPO = Path(__file__).resolve().parents[1]


def test_every_family_part_resolves() -> None:
    assert set(registry.FAMILIES) == {"medusa", "eagle", "eagle3", "block"}
    for fam in registry.FAMILIES.values():
        assert callable(fam.load("head").from_pretrained) and callable(fam.load("drafter"))
        assert (REPO / (fam.trainer.removeprefix("draftheads.").replace(".", "/") + ".py")).is_file()
    assert registry.get("medusa").load("shape") is shapes.STATIC and registry.get("eagle3").load("shape") is shapes.DYNAMIC
    assert registry.shape_of("prompt_lookup") is shapes.LOOKUP and registry.shape_of("draft_model") is shapes.DRAFT_MODEL
    assert registry.shape_of("medusa-init") is shapes.STATIC and registry.shape_of("plain") is shapes.NONE
    for b in registry.BASELINES.values():
        assert callable(b.load("drafter")), b.name
    exporters = {f.name: f.load("exporter") for f in registry.FAMILIES.values() if f.exporter}
    assert set(exporters) == {"eagle3", "block"}
    for mod in exporters.values():
        assert mod.FORMATS and callable(mod.export_job)


def test_unknown_family_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown draft family 'gpt'; registered: medusa, eagle, eagle3, block"):
        registry.get("gpt")


class ToyDrafter:
    """A toy family's drafter: follows the last successor of each token seen so far (a bigram memory), a chain."""

    layers: tuple[int, ...] = ()

    def __init__(self, k: int):
        self.k, self.seq = k, []

    def begin(self, prompt_ids: torch.Tensor, hidden: Any) -> None:
        self.seq = torch.as_tensor(prompt_ids).view(-1).tolist()

    def propose(self, root: int, sampling: Any, generator: Any) -> DraftTree:
        nxt = {a: b for a, b in zip(self.seq, self.seq[1:])}
        self.seq.append(int(root))
        chain = [int(root)]
        while len(chain) <= self.k and chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        n = len(chain)
        return DraftTree(torch.tensor(chain), torch.arange(-1, n - 1), None, torch.arange(n))

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: Any) -> None:
        self.seq.extend(tree.tokens[list(path[1:])].tolist())


TOY_SHAPE = shapes.ChainShape("depth", probe_len=4, section="tree")  # a chain sized by tree.depth


def _toy_drafter(target, head, tree_cfg, dtype, allow_target_mismatch=False):
    from draftheads.heads.checkpoint import read_head

    read_head(head, "toy")
    return ToyDrafter(int(tree_cfg.get("depth") or 3)), {"drafter": "toy", "head": head}


def _register_toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.FAMILIES, "toy", registry.Family(
        "toy", "draftheads.heads.eagle:EagleDraft", "test_registry:_toy_drafter", "draftheads.train.eagle",
        "test_registry:TOY_SHAPE", "a toy", "Toy draft"))


def test_a_new_family_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered family is reachable from the eval factory, sweeps, tree=auto and publish without touching them."""
    from draftheads.eval import autotree_knobs, measure_methods
    from draftheads.scripts import publish

    _register_toy(monkeypatch)
    assert registry.shape_of("toy") is TOY_SHAPE
    assert autotree_knobs.free_knobs("toy", {"select": "auto", "depth": None}, {}) == ["depth"]
    assert autotree_knobs.free_knobs("toy", {"select": "auto", "depth": 2}, {}) == []
    tree, base = measure_methods.sized_configs(measure_methods.Method("t", "toy", "dir"),
                                               compose("measure", []), 5)
    assert tree["depth"] == 4 and tree["select"] == "default"
    assert measure_methods.sweep_axis("toy") == "chain_sizes"
    assert publish._title("toy") == "Toy draft" and publish._title("nope") == "nope"


def test_a_toy_family_registered_here_decodes_through_measure(monkeypatch: pytest.MonkeyPatch, tiny_target_dir,
                                                               tmp_path: Path) -> None:
    """eval/measure.py runs a family it has never heard of: greedy output identical to plain on every turn, drafts
    accepted on a repetitive prompt, and its chain swept at two sizes."""
    from safetensors.torch import save_file

    from draftheads.eval.measure import main
    from draftheads.heads.checkpoint import FORMAT

    _register_toy(monkeypatch)
    head = tmp_path / "toy-head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"format": FORMAT, "family": "toy"}))
    save_file({"unused": torch.zeros(1)}, str(head / "model.safetensors"))
    qfile = tmp_path / "q.jsonl"
    qs = [{"question_id": 1, "category": "copy", "turns": ["one two three four one two three four one two three"]},
          {"question_id": 2, "category": "copy", "turns": ["red blue green red blue green red blue"]}]
    qfile.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    res = main(compose("measure", [
        "target=hf", f"target.name={tiny_target_dir}", "target.dtype=fp32", "target.local_files_only=true",
        f"questions={qfile}", "max_new_tokens=24", "temperatures=[]", f"out_dir={tmp_path / 'm'}", "methods=[plain]",
        f"+heads.toy={head}", "profile.widths=[1,4]", "profile.repeats=1", "sweep.chain_sizes=[2,4]",
        "sweep.tree_sizes=[]", "sweep.max_questions=1", "sweep.max_new_tokens=8", "tree.select=default"]))
    g = json.loads((tmp_path / "m" / "results.json").read_text())["settings"]["greedy"]
    assert g["greedy_identical"]["toy"]["identical"] == g["greedy_identical"]["toy"]["comparable_turns"] == 2
    assert g["methods"]["toy"]["tau"] > 1.0  # the bigram chain copies the repeated words
    sweep = json.loads((tmp_path / "m" / "results.json").read_text())["sweep"]["toy"]
    assert [p["size"] for p in sweep] == [2, 4] and sweep[0]["mean_tree_size"] < sweep[1]["mean_tree_size"], res


SHARED = ["eval/drafters.py", "eval/measure.py", "eval/measure_methods.py", "eval/measure_run.py",
          "eval/measure_summary.py", "eval/autotree.py", "eval/autotree_knobs.py", "eval/autotree_model.py",
          "eval/acceptance.py", "scripts/publish.py", "draftheads/cli.py", "pipeline/tau_eval.py",
          "pipeline/eval_after.py", "scripts/export.py"]


# code that serves every drafter: no comparison against a shape or baseline name either (shapes decide)
SHAPE_FREE = ["eval/autotree.py", "eval/autotree_knobs.py", "eval/autotree_model.py", "eval/measure.py",
              "eval/measure_methods.py", "eval/measure_run.py", "eval/measure_summary.py", "eval/generate.py",
              "eval/acceptance.py", "scripts/publish.py"]


@pytest.mark.parametrize("path", SHARED)
def test_shared_code_does_not_branch_on_a_family_name(path: str) -> None:
    """No `x == "eagle3"` / `x in ("medusa", ...)` comparisons in code that serves every family."""
    names = set(registry.FAMILIES) | ({"static", "dynamic", "chain", *registry.BASELINES} if path in SHAPE_FREE
                                      else set())
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.Compare):
            consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            assert not consts, f"{path}:{node.lineno} compares against family or shape name {consts[0].value!r}"
