"""Tests of the statistical exactness harness (eval/exactness.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from draftheads.eval.exactness import (
    TREE_SHAPES,
    build_trees,
    chi2_tv,
    format_table,
    make_toy_tables,
    run_exactness,
    sample_without_replacement,
)
from draftheads.eval.verify import tree_children


@pytest.mark.slow
def test_exactness_job_passes_exact_and_detects_negative_controls(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "exactness.json"
    cfg = SimpleNamespace(rounds=15000, seed=0, vocab_size=6, alpha=1e-3, tv_factor=3.0, out=str(out))
    report = run_exactness(cfg)
    cases = report["cases"]
    for name in ("exact_sampled", "exact_topk"):
        assert cases[name]["consistent_with_target"], format_table(report)
        assert cases[name]["p_value"] > 1e-3
        assert cases[name]["tv"] < 3 * cases[name]["tv_null"]
    for name in ("typical_topk", "broken_residual_sampled"):
        assert not cases[name]["consistent_with_target"], format_table(report)
        assert cases[name]["p_value"] < 1e-10  # clearly detected, not borderline
    assert report["all_ok"]
    assert json.loads(out.read_text())["cases"].keys() == cases.keys()
    assert not list(out.parent.glob("*.tmp*"))  # atomic write leaves no temp file


def test_sample_without_replacement_matches_sequential_sampling() -> None:
    rng = np.random.default_rng(0)
    q = np.array([0.5, 0.3, 0.15, 0.05])
    n = 40000
    draws = sample_without_replacement(np.broadcast_to(q, (n, 4)), 2, rng)
    assert (draws[:, 0] != draws[:, 1]).all()
    counts = np.zeros((4, 4))
    np.add.at(counts, (draws[:, 0], draws[:, 1]), 1)
    expected = q[:, None] * q[None, :] / (1 - q[:, None])  # P(c1=a) P(c2=b | c1=a)
    np.fill_diagonal(expected, 0.0)
    mask = expected > 0
    assert stats.chisquare(counts[mask], expected[mask] * n).pvalue > 1e-3


def test_build_trees_layout() -> None:
    rng = np.random.default_rng(1)
    tables = make_toy_tables(6, rng)
    parents = TREE_SHAPES["medusa_like"]
    r = 50
    prev, root = np.full(r, 2), np.full(r, 3)
    tokens, tp, dp = build_trees(parents, prev, root, tables, "sampled", rng)
    assert tokens.shape == (r, len(parents)) and tp.shape == dp.shape == (r, len(parents), 6)
    for i in range(1, len(parents)):
        j = parents[i]
        prev_j = prev if j == 0 else tokens[:, parents[j]]
        np.testing.assert_allclose(dp[:, i], tables.draft[prev_j, tokens[:, j]])
        np.testing.assert_allclose(tp[:, i], tables.target[tokens[:, j], tokens[:, i]])
    for kids in tree_children(parents):  # siblings drawn without replacement: all distinct
        assert all(len(set(row)) == len(kids) for row in tokens[:, kids].tolist())
    tok_k, _, dp_k = build_trees(parents, prev, root, tables, "topk", rng)
    assert dp_k is None
    assert (tok_k[:, 1] == np.argmax(tables.draft[2, 3])).all()


def test_chi2_tv_pools_small_cells() -> None:
    probs = np.array([0.5, 0.4999, 0.0001])
    counts = np.array([500, 500, 0])
    st = chi2_tv(counts, probs)
    assert st["pooled_cells"] == 1 and st["dof"] == 2
    assert st["tv"] < 1e-3 and st["p_value"] > 0.5
