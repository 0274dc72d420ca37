"""docs/configuration.md is generated from conf/ and must match it: a new or changed field shows up in review."""

from __future__ import annotations

from pathlib import Path

from draftheads.scripts import config_reference as ref


def test_reference_is_current() -> None:
    assert ref.main(["--check"]) == 0, "run: python scripts/config_reference.py"


def test_rows_read_nesting_defaults_and_docs(tmp_path: Path) -> None:
    y = tmp_path / "x.yaml"
    y.write_text("# A job.\ndefaults:\n  - target: smollm2-135m  # which target\n  - _self_\n"
                 "lr: 1.0e-3  # peak learning rate\ntree:\n  kind: auto  # static | dynamic\n  depth: 6  # levels\n"
                 "paths: null\n")
    assert ref.rows(y, "eval.") == [("eval.lr", "1.0e-3", "peak learning rate"), ("eval.tree.kind", "auto", "static | dynamic"),
                                    ("eval.tree.depth", "6", "levels"), ("eval.paths", "null", "")]
    assert ref.first_comment(y) == "A job."
