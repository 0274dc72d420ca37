"""Statistical check that the "exact" tree verification rule preserves the target distribution.

A toy target (a fixed random second-order Markov table, so the target's
distribution depends on the path) and a deliberately bad toy drafter (another,
unrelated table). Every round drafts a tree from the drafter, verifies it with
the real :func:`eval.verify.verify_tree`, and records the first two emitted
tokens (x1, x2); when a round emits only one token, a second round from the new
root supplies x2, as decoding would. The empirical joint of (x1, x2) is compared
with the target's exact p(x1) p(x2 | x1) by a chi-square test and total variation.

Cases: ``exact`` with children sampled without replacement from the drafter,
``exact`` with deterministic top-k children (both must pass), and two negative
controls that must fail, proving the test has power: Medusa's ``typical``
acceptance and a broken exact rule that skips the residual update on rejection.

Run: ``PYTHONPATH=. python eval/exactness.py rounds=100000 seed=0 out=runs/exactness/exactness.json``
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from scipy import stats

from draftheads.eval.verify import _prob_row, _sample, _uniforms, tree_children, verify_tree
from draftheads.heads import job

VerifyFn = Callable[..., tuple[list[int], int]]

# Root context (previous token, root token) of every first round.
ROOT_CONTEXT = (0, 1)

# Tree shapes as parent lists (depth 2-3, branching 2-3); rounds rotate through them.
TREE_SHAPES: dict[str, list[int]] = {
    "full_3x2": [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3],  # depth 2, 10 nodes
    "full_2x2x2": [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6],  # depth 3, 15 nodes
    "medusa_like": [-1, 0, 0, 0, 1, 1, 2, 4, 4],  # depth 3, first branches deepest
}


@dataclass(frozen=True)
class ToyTables:
    """target[a, b] / draft[a, b]: next-token distribution [V] after tokens (a, b). Shapes [V, V, V]."""

    target: np.ndarray
    draft: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.target.shape[-1]


@dataclass(frozen=True)
class Case:
    name: str
    verify: VerifyFn
    children: str  # "sampled" (without replacement from the drafter) or "topk"
    expect_exact: bool


def make_toy_tables(vocab_size: int, rng: np.random.Generator) -> ToyTables:
    """Random target and an unrelated (bad) drafter, both with full support.

    The target has a floor of 0.2/V per token so every (x1, x2) cell has a
    usable expected count; the drafter is peaky (Dirichlet 0.3) and independent
    of the target, so rejections and residual samples are frequent.
    """
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4 for trees with 3 siblings, got {vocab_size}")
    v = vocab_size
    target = 0.8 * rng.dirichlet(np.ones(v), size=(v, v)) + 0.2 / v  # [V, V, V]
    draft = 0.9 * rng.dirichlet(np.full(v, 0.3), size=(v, v)) + 0.1 / v  # [V, V, V]
    return ToyTables(target / target.sum(-1, keepdims=True), draft / draft.sum(-1, keepdims=True))


def sample_without_replacement(q: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Draw k distinct tokens per row of q [..., V], in sampling order -> [..., k].

    Gumbel-top-k (Kool et al. 2019): the order of log q + Gumbel noise is exactly
    the order of sequential sampling without replacement (c1 ~ q, c2 ~ q without
    c1 renormalized, ...). Rows need at least k tokens of positive mass.
    """
    if k > q.shape[-1]:
        raise ValueError(f"cannot draw {k} distinct tokens from a vocab of {q.shape[-1]}")
    with np.errstate(divide="ignore"):
        keys = np.log(q) + rng.gumbel(size=q.shape)  # [..., V]
    return np.argsort(-keys, axis=-1, kind="stable")[..., :k]


def build_trees(
    parents: list[int],
    root_prev: np.ndarray,
    root_tok: np.ndarray,
    tables: ToyTables,
    children: str,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Draft R trees of one shape from per-round root contexts (root_prev, root_tok) [R].

    Returns tokens [R, N], target_probs [R, N, V] and draft_probs [R, N, V]
    (None for deterministic top-k children), laid out as verify_tree expects.
    """
    kids = tree_children(parents)
    r, n = root_tok.shape[0], len(parents)
    tokens = np.zeros((r, n), dtype=np.int64)
    prev = np.zeros((r, n), dtype=np.int64)  # token before each node's token
    tokens[:, 0], prev[:, 0] = root_tok, root_prev
    for j in range(n):  # parents[i] < i, so node j's token is set before its children
        if not kids[j]:
            continue
        q = tables.draft[prev[:, j], tokens[:, j]]  # [R, V] drafter at node j
        if children == "sampled":
            chosen = sample_without_replacement(q, len(kids[j]), rng)  # [R, k]
        elif children == "topk":
            chosen = np.argsort(-q, axis=-1, kind="stable")[:, : len(kids[j])]  # [R, k]
        else:
            raise ValueError(f"unknown children mode {children!r}")
        tokens[:, kids[j]] = chosen
        prev[:, kids[j]] = tokens[:, [j]]
    target_probs = tables.target[prev, tokens]  # [R, N, V]
    if children == "topk":
        return tokens, target_probs, None
    q_at = tables.draft[prev, tokens]  # [R, N, V] drafter's distribution at each node
    draft_probs = q_at[:, [max(p, 0) for p in parents]]  # row i: q at parent(i); row 0 unused
    return tokens, target_probs, draft_probs


def broken_verify_tree(
    tokens: torch.Tensor,
    parents: list[int] | torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """NEGATIVE CONTROL: the exact rule without the residual update (p unchanged on rejection).

    Rejected tokens keep their target mass and the fallback sample comes from p
    instead of the residual, so tokens the drafter proposes get too much mass.
    Must be detected as biased by the exactness check.
    """
    tok = [int(t) for t in tokens.tolist()]
    children = tree_children(parents)
    uniforms = _uniforms(len(tok) + 1, generator)
    n_used, node, accepted = 0, 0, []
    while True:
        p = _prob_row(target_probs, node, "target_probs")  # [V]
        kids = children[node]
        q = _prob_row(draft_probs, kids[0], "draft_probs") if (draft_probs is not None and kids) else None
        moved = False
        for c in kids:
            t = tok[c]
            q_t = float(q[t]) if q is not None else 0.0
            accept_prob = min(1.0, float(p[t]) / q_t) if q_t > 0 else float(p[t])
            u = uniforms[n_used]
            n_used += 1
            if u < accept_prob:
                accepted.append(c)
                node, moved = c, True
                break
            if q is not None:  # keep the drafter's without-replacement update, skip the target's
                q = q.clone()
                q[t] = 0.0
                q = q / q.sum() if float(q.sum()) > 0 else q
        if not moved:
            return accepted, _sample(p, uniforms[n_used])


def default_cases() -> list[Case]:
    return [
        Case("exact_sampled", partial(verify_tree, mode="exact"), "sampled", True),
        Case("exact_topk", partial(verify_tree, mode="exact"), "topk", True),
        Case("typical_topk", partial(verify_tree, mode="typical"), "topk", False),
        Case("broken_residual_sampled", broken_verify_tree, "sampled", False),
    ]


def _verify_batch(
    verify: VerifyFn,
    parents: list[int],
    tokens: np.ndarray,
    target_probs: np.ndarray,
    draft_probs: np.ndarray | None,
    generator: torch.Generator,
) -> list[list[int]]:
    """Call the verifier once per round; return the emitted tokens of every round."""
    tok_t, tp_t = torch.from_numpy(tokens), torch.from_numpy(target_probs)
    dp_t = torch.from_numpy(draft_probs) if draft_probs is not None else None
    par_t = torch.tensor(parents)
    emitted = []
    for r in range(tokens.shape[0]):
        accepted, nxt = verify(tok_t[r], par_t, tp_t[r], dp_t[r] if dp_t is not None else None, generator=generator)
        emitted.append([int(tokens[r, a]) for a in accepted] + [nxt])
    return emitted


def first_two_tokens(
    case: Case, tables: ToyTables, rounds: int, rng: np.random.Generator, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray, float]:
    """Sample (x1, x2) `rounds` times; return x1 [R], x2 [R] and mean tokens emitted per first round."""
    x1 = np.empty(rounds, dtype=np.int64)
    x2 = np.empty(rounds, dtype=np.int64)
    emitted_total = 0
    shapes = list(TREE_SHAPES.values())
    bounds = np.linspace(0, rounds, len(shapes) + 1).astype(int)
    for parents, lo, hi in zip(shapes, bounds[:-1], bounds[1:]):
        r = hi - lo
        if r == 0:
            continue
        prev0, tok0 = np.full(r, ROOT_CONTEXT[0]), np.full(r, ROOT_CONTEXT[1])
        trees = build_trees(parents, prev0, tok0, tables, case.children, rng)
        emitted = _verify_batch(case.verify, parents, *trees, generator)
        emitted_total += sum(len(e) for e in emitted)
        x1[lo:hi] = [e[0] for e in emitted]
        short = np.array([i for i, e in enumerate(emitted) if len(e) == 1], dtype=np.int64)
        for i, e in enumerate(emitted):
            if len(e) > 1:
                x2[lo + i] = e[1]
        if short.size:  # continue decoding from (root token, x1) to get the second token
            trees2 = build_trees(parents, tok0[short], x1[lo + short], tables, case.children, rng)
            emitted2 = _verify_batch(case.verify, parents, *trees2, generator)
            x2[lo + short] = [e[0] for e in emitted2]
    return x1, x2, emitted_total / rounds


def target_joint(tables: ToyTables) -> np.ndarray:
    """Exact joint [V, V] of the first two tokens after ROOT_CONTEXT: p(x1) p(x2 | x1)."""
    a, b = ROOT_CONTEXT
    p1 = tables.target[a, b]  # [V]
    p2 = tables.target[b]  # [V(x1), V(x2)]
    return p1[:, None] * p2


def chi2_tv(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> dict[str, float]:
    """Chi-square goodness of fit and total variation of counts against probs (same shape).

    Cells with expected count below `min_expected` are pooled into one cell
    (the usual validity condition for the chi-square approximation).
    """
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    total = counts.sum()
    assert total > 0 and abs(probs.sum() - 1.0) < 1e-9
    expected = probs * total
    small = expected < min_expected
    obs_cells, exp_cells = list(counts[~small]), list(expected[~small])
    if small.any():
        obs_cells.append(counts[small].sum())
        exp_cells.append(expected[small].sum())
    res = stats.chisquare(np.array(obs_cells), np.array(exp_cells))
    dof = len(obs_cells) - 1
    log10_p = float(stats.chi2.logsf(res.statistic, dof)) / math.log(10)
    tv = 0.5 * float(np.abs(counts / total - probs).sum())
    # Expected TV of an exact sampler (normal approximation, E|X - mu| = sigma sqrt(2/pi)).
    tv_null = 0.5 * float(np.sqrt(2.0 * probs * (1.0 - probs) / (math.pi * total)).sum())
    return {
        "chi2": float(res.statistic),
        "dof": dof,
        "p_value": float(res.pvalue),
        "log10_p": log10_p if math.isfinite(log10_p) else None,  # None: underflow, p is astronomically small
        "tv": tv,
        "tv_null": tv_null,
        "pooled_cells": int(small.sum()),
    }


def run_exactness(cfg: Any, cases: list[Case] | None = None) -> dict[str, Any]:
    """Run every case; return (and write atomically to cfg.out, if set) the JSON report.

    cfg needs: rounds, seed, vocab_size, alpha, tv_factor, out (None/"" to skip writing).
    An exact case is consistent when p > alpha and TV <= tv_factor * tv_null; a
    negative control is ok when the test detects it (p < alpha).
    """
    start = time.perf_counter()
    rounds, seed, alpha = int(cfg.rounds), int(cfg.seed), float(cfg.alpha)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    tables = make_toy_tables(int(cfg.vocab_size), np.random.default_rng([seed, 0]))
    joint = target_joint(tables)
    v = tables.vocab_size
    results: dict[str, dict[str, Any]] = {}
    for idx, case in enumerate(cases if cases is not None else default_cases()):
        t0 = time.perf_counter()
        rng = np.random.default_rng([seed, 1, idx])
        gen = torch.Generator().manual_seed(seed * 1_000 + idx)
        x1, x2, mean_emitted = first_two_tokens(case, tables, rounds, rng, gen)
        counts = np.bincount(x1 * v + x2, minlength=v * v).reshape(v, v)
        st = chi2_tv(counts, joint)
        consistent = st["p_value"] > alpha and st["tv"] <= float(cfg.tv_factor) * st["tv_null"]
        results[case.name] = {
            "children": case.children,
            "expect_exact": case.expect_exact,
            "rounds": rounds,
            **st,
            "consistent_with_target": consistent,
            "ok": consistent == case.expect_exact,
            "mean_tokens_first_round": mean_emitted,
            "seconds": time.perf_counter() - t0,
        }
    report = {
        "config": {k: _plain(getattr(cfg, k)) for k in ("rounds", "seed", "vocab_size", "alpha", "tv_factor")},
        "tree_shapes": TREE_SHAPES,
        "cases": results,
        "all_ok": all(r["ok"] for r in results.values()),
        "seconds": time.perf_counter() - start,
    }
    out = getattr(cfg, "out", None)
    if out:
        _write_json_atomic(str(out), report)
    return report


def format_table(report: dict[str, Any]) -> str:
    head = f"{'case':<26}{'expect':>8}{'chi2':>10}{'dof':>5}{'p':>11}{'log10p':>9}{'TV':>8}{'TVnull':>8}{'tok/rnd':>8}  ok"
    lines = [head, "-" * len(head)]
    for name, r in report["cases"].items():
        lines.append(
            f"{name:<26}{'exact' if r['expect_exact'] else 'biased':>8}{r['chi2']:>10.1f}{r['dof']:>5}"
            f"{r['p_value']:>11.3g}{_fmt_log10p(r['log10_p']):>9}{r['tv']:>8.4f}{r['tv_null']:>8.4f}"
            f"{r['mean_tokens_first_round']:>8.2f}  {'OK' if r['ok'] else 'FAIL'}"
        )
    lines.append(f"all_ok={report['all_ok']}  ({report['seconds']:.1f} s)")
    return "\n".join(lines)


def _fmt_log10p(x: float | None) -> str:
    return "<-300" if x is None else f"{x:.1f}"


def _plain(x: Any) -> Any:
    return x if isinstance(x, (int, float, str, bool)) or x is None else str(x)


def _write_json_atomic(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


@job.main(config_name="exactness")
def main(cfg: DictConfig) -> None:
    print(format_table(run_exactness(cfg)))


if __name__ == "__main__":
    main()
