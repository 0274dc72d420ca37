"""Summaries of eval/measure.py's result rows: τ, tokens/s and the per-step time split, acceptance by depth against
the seed's formula, greedy identity with plain decoding, speedups, head-to-head intervals, tree=auto's choices and
the headline.

Apart from the job because these are pure functions of rows (tested on toy rows; scripts reuse them on old runs).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import numpy as np

from draftheads.eval.acceptance import first_divergence
from draftheads.eval.autotree import ratio
from draftheads.eval.measure_methods import Method
from draftheads.eval.tau import paired_forwards, tau
from draftheads.heads import registry


def formula_tau(alpha: float, k: int) -> float:
    """The seed's expected tokens per step with k drafts accepted i.i.d. with probability alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def depth_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance by depth from per-step accepted counts and tree depths (speculative rows only).

    accept_at_depth[d-1] = P(accepted ≥ d) over all steps; conditional[d-1] = P(accepted ≥ d | accepted ≥
    d-1 and the tree reaches depth d). α pooled over depths = Σ successes / Σ trials is the i.i.d.
    estimate that the seed's formula assumes; formula τ averages (1 − α^(k+1))/(1 − α) over the steps'
    own depths k (steps that drafted nothing contribute 1).
    """
    acc = [a for r in rows if r.get("accepted") is not None for a in r["accepted"]]
    dep = [d for r in rows if r.get("tree_depths") is not None for d in r["tree_depths"]]
    if not acc:
        return {"accept_at_depth": [], "conditional_accept": [], "alpha": None, "formula_tau": None,
                "measured_tau": None, "max_depth": 0}
    K = max(dep) if dep else 0
    a, k = np.asarray(acc), np.asarray(dep)
    at_depth, cond, succ_total, trials_total = [], [], 0, 0
    for d in range(1, K + 1):
        succ = int((a >= d).sum())
        trials = int(((a >= d - 1) & (k >= d)).sum())
        at_depth.append(round(succ / len(a), 4))
        cond.append(round(succ / trials, 4) if trials else None)
        succ_total += succ
        trials_total += trials
    alpha = succ_total / trials_total if trials_total else 0.0
    ftau = float(np.mean([formula_tau(alpha, int(x)) for x in k]))
    return {"accept_at_depth": at_depth, "conditional_accept": cond, "alpha": round(alpha, 4),
            "formula_tau": round(ftau, 4), "formula_tau_at_max_depth": round(formula_tau(alpha, K), 4),
            "measured_tau": round(float((a + 1).mean()), 4), "max_depth": int(K)}


def aggregate(rows: list[dict[str, Any]], t1_ms: float | None = None) -> dict[str, Any]:
    """τ, throughput and the per-step time split of a set of turns."""
    steps = sum(r["steps"] for r in rows)
    new = sum(r["new_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    pre = sum(r["prefill_seconds"] for r in rows)
    tgt = sum(r["target_seconds"] for r in rows)
    drf = sum(r["draft_seconds"] for r in rows)
    book = secs - pre - tgt - drf
    per = lambda x: round(1000 * x / max(1, steps), 3)  # noqa: E731 - ms per verification step
    out = {"turns": len(rows), "steps": steps, "new_tokens": new, "seconds": round(secs, 3),
           "tau": round(tau(rows), 4), "tokens_per_s": round(new / max(secs, 1e-9), 3),
           "decode_tokens_per_s": round(max(0, new - len(rows)) / max(secs - pre, 1e-9), 3),
           "target_ms_per_step": per(tgt), "draft_ms_per_step": per(drf), "bookkeeping_ms_per_step": per(book),
           "prefill_s": round(pre, 3)}
    widths = [r["tree_sizes_mean"] * r["steps"] for r in rows if r.get("tree_sizes_mean") is not None]
    if widths:
        out["mean_tree_size"] = round(sum(widths) / max(1, sum(r["steps"] for r in rows
                                                                if r.get("tree_sizes_mean") is not None)), 3)
    oov = [r for r in rows if r.get("out_of_draft_vocab") is not None]
    if oov:  # share of emitted tokens outside an EAGLE-3 draft vocabulary (never proposable)
        out["draft_vocab_oov"] = round(sum(r["out_of_draft_vocab"] for r in oov)
                                       / max(1, sum(r["new_tokens"] for r in oov)), 4)
    if t1_ms:
        out["bookkeeping_pct_of_t1"] = round(100 * out["bookkeeping_ms_per_step"] / t1_ms, 2)
    if out["target_ms_per_step"]:
        out["bookkeeping_pct_of_verify"] = round(100 * out["bookkeeping_ms_per_step"] / out["target_ms_per_step"], 2)
    return out


def summarize_method(rows: list[dict[str, Any]], t1_ms: float | None) -> dict[str, Any]:
    out = aggregate(rows, t1_ms)
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    out["per_category"] = {c: aggregate(rs, t1_ms) for c, rs in sorted(cats.items())}
    out["depth"] = depth_stats(rows)
    return out


def greedy_identity(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Token-by-token comparison with plain greedy, on turns whose prompt is the same as plain's."""
    ref = {(r["question_id"], r["turn"]): r for r in ref_rows}
    comparable, identical, div = 0, 0, []
    for r in rows:
        p = ref.get((r["question_id"], r["turn"]))
        if p is None or p["prompt_hash"] != r["prompt_hash"]:
            continue  # an earlier turn diverged, so this prompt differs: not comparable
        comparable += 1
        d = first_divergence(r["tokens"], p["tokens"])
        r["first_divergence"] = d
        if d is None:
            identical += 1
        else:
            div.append(d)
    return {"comparable_turns": comparable, "identical": identical, "first_divergence": div,
            "median_first_divergence": statistics.median(div) if div else None}


def turns_skipped(questions: list[dict[str, Any]], by: dict[str, list[dict[str, Any]]],
                  max_turns: int) -> dict[str, int]:
    """Per method, turns asked for (the first ``max_turns`` of each question) that it never measured: a prompt
    longer than ``max_prompt_tokens`` ends its question early. Reported so that "80 questions" never hides 78."""
    asked = sum(min(len(q["turns"]), max_turns) for q in questions)
    return {name: asked - len(rows) for name, rows in by.items()}


def head_to_head(by: dict[str, list[dict[str, Any]]], names: list[str], seed: int = 0,
                 boot: int = 10000) -> list[dict[str, Any]]:
    """Every pair of heads measured together: B's target forwards saved over A on the same turns, with a
    paired-bootstrap 95% interval over questions (eval/tau.py; a question's turns are resampled together) - is a
    τ lead more than prompt noise?"""
    keyed = {n: {(r["question_id"], r["turn"]): r for r in by[n]} for n in names}
    return [paired_forwards(keyed[a], keyed[b], a, b, boot, seed, strict=False, cluster=lambda k: k[0])
            for i, a in enumerate(names) for b in names[i + 1:]]


def speedups(summ: dict[str, dict[str, Any]], ref: str) -> dict[str, Any]:
    """tokens/s of every method over ``ref``'s, overall and per category."""
    if ref not in summ:
        return {}
    base = summ[ref]
    out = {}
    for name, s in summ.items():
        cat = {c: round(v["tokens_per_s"] / base["per_category"][c]["tokens_per_s"], 3)
               for c, v in s["per_category"].items()
               if c in base["per_category"] and base["per_category"][c]["tokens_per_s"] > 0}
        out[name] = {"overall": round(s["tokens_per_s"] / max(base["tokens_per_s"], 1e-9), 3), "per_category": cat}
    return out

def tree_choices(methods: list[Method], per_setting: dict[str, Any]) -> dict[str, Any]:
    """tree=auto per method: the chosen tree, its modeled speedup, and the greedy run's measured one and their ratio."""
    g = (per_setting.get("greedy") or {})
    out = {}
    for m in methods:
        if not m.choice:
            continue
        c = dict(m.choice)
        if g:
            c["measured_tau"] = g["methods"][m.name]["tau"]
            c["measured_speedup"] = g["speedup_vs_plain"][m.name]["overall"]
            c["measured_over_modeled"] = ratio(c["measured_speedup"], c["chosen"]["modeled_speedup"])
        out[m.name] = c
    return out


def headline(per_setting: dict[str, Any], methods: list[Method]) -> dict[str, Any]:
    """The best trained head (by greedy tokens/s) and what it buys over plain and over HF prompt lookup."""
    g = per_setting.get("greedy")
    if not g:
        return {}
    heads = [m.name for m in methods if m.checkpoint]
    cands = heads or [m.name for m in methods if registry.shape_of(m.kind).drafts]
    if not cands:
        return {}
    best = max(cands, key=lambda n: g["methods"][n]["tokens_per_s"])
    s = g["methods"][best]
    out = {"best": best, "trained": bool(heads), "tau": s["tau"], "tokens_per_s": s["tokens_per_s"],
           "speedup_vs_plain": g["speedup_vs_plain"][best]["overall"],
           "bookkeeping_ms_per_step": s["bookkeeping_ms_per_step"],
           "bookkeeping_pct_of_t1": s.get("bookkeeping_pct_of_t1")}
    if g.get("speedup_vs_hf_prompt_lookup"):
        out["speedup_vs_hf_prompt_lookup"] = g["speedup_vs_hf_prompt_lookup"][best]["overall"]
    if "greedy_identical" in g and best in g["greedy_identical"]:
        gi = g["greedy_identical"][best]
        out["greedy_identical"] = f"{gi['identical']}/{gi['comparable_turns']}"
    return out

