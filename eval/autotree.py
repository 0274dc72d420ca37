"""tree=auto: pick each drafter's tree (or chain) for the most modeled tokens/s on this device.

    modeled tokens/s ∝ E[accepted + 1 | tree] / (t_verify(width) + t_draft(tree) + bookkeeping(width))

Why: a tree that verifies 64 tokens costs ~3× a one-token forward on a CPU, so the right tree depends
on the head *and* the hardware; fixed 60–64-node defaults made trained heads slower than plain decoding.

* E[accepted + 1 | tree]: ``eval.trees.expected_tokens`` over a per-depth, per-rank acceptance table
  (eval/calibration.py), measured on a few calibration prompts from the data's held-out split — never the questions being
  measured (``calibration_split``). One *probe* run of the real decoding loop drafts a wide tree; per
  step the target's own continuation is looked up among the drafted nodes (rank = sibling order, best
  first) and counted hazard-style: P(rank r | not a lower rank), so a rank the probe did not draft is
  unobserved rather than a miss. Chains (prompt lookup, draft model) propose prefixes of the probe's
  chain, so there a missing node *is* a miss and the estimate equals 1 + mean(min(accepted, k)).
* t_verify(width): the latency profile of this device (eval/latency.py, cached), scaled to the target
  ms per step the timed calibration runs measured in the loop (``anchored_verify``).
* t_draft: the drafter's per-step time, timed through the decoding loop (its public protocol) on a
  calibration prompt for a few configurations of the family's cost knob, interpolated between them.
* bookkeeping (everything outside the forwards): a line in the width, fitted over the same runs.

Knobs the user set (``tree.size=16``, ``tree.depth=4``, ``baselines.lookup_tokens=5``) are kept; only
null knobs are chosen, and ``tree.select=default`` fills them with the fixed family defaults instead.

The parts: which knobs are free and their defaults (eval/autotree_knobs.py), the candidates and the cost model
(eval/autotree_model.py); this file probes, times, ranks and reports.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from draftheads.eval.autotree_knobs import fill_defaults, free_knobs
from draftheads.eval.autotree_model import Candidate, anchored_verify
from draftheads.eval.calibration import Calibration, _book_line, _Recorder, acceptance_table, time_drafters
from draftheads.eval.generate import NoDrafter, generate
from draftheads.eval.tau import tau_value
from draftheads.heads import registry

log = logging.getLogger(__name__)

# tree.lookup_branch lengths tree=auto measures on the calibration prompts: up to prompt lookup's own longest probe (16,
# eval/shapes.py LOOKUP), so where answers copy long runs (extraction, a base model's echoes) the merged tree copies as
# far as prompt lookup does (on Gemma 3 270M's MT-bench answers, a 10-token branch reached τ 7.9 against lookup's 9.3)
LOOKUP_BRANCH = (0, 3, 6, 10, 16)
NARROW = 8  # widest head tree also tried under a lookup branch when the head's best alone is wider


# --------------------------------------------------------------------------------------------
# The choice: probe, time, rank the candidates (eval/autotree_model.py)
# --------------------------------------------------------------------------------------------

def choose(kind: str, make: Callable[[dict[str, Any], dict[str, Any]], Any], target: Any, tree: dict[str, Any],
           baselines: dict[str, Any], calib: Calibration, profile: dict[str, Any], new_tokens: int,
           timing_tokens: int = 24, num_heads: int = 4, prior: Any = None, eos: Iterable[int] = (),
           ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Choose the free knobs of ``kind``'s tree; returns (tree cfg, baselines cfg, choice report).

    ``make(tree, baselines)`` builds a drafter; ``prior`` = the checkpoint's per-rank accuracies (Medusa),
    used only to shape the probe tree. The report carries the table, the timings, the chosen tree's
    modeled E[accepted + 1] and speedup over plain, the family default's for comparison, and runners-up.
    """
    t0 = time.perf_counter()
    free = free_knobs(kind, tree, baselines)
    if not free:
        t, b = fill_defaults(kind, tree, baselines)
        return t, b, {}
    if "lookup_branch" in free:  # the head's own tree first (no branch), then the branch on top of it
        head = {**tree, "lookup_branch": 0}
        out_tree, out_base, report = choose(kind, make, target, head, baselines, calib, profile, new_tokens,
                                            timing_tokens, num_heads, prior, eos)
        heads = [out_tree]
        if report.get("narrow"):  # a cheap head tree may pay more once copying covers the long accepts
            heads.append(fill_defaults(kind, head, baselines, report["narrow"])[0])
        out_tree, report = choose_lookup_branch(make, target, heads, out_base, calib, profile, new_tokens,
                                                timing_tokens, eos, report)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        return out_tree, out_base, report
    shape = registry.shape_of(kind)  # eval/shapes.py: probe, timing configs, candidates, draft-cost model
    probe_tree, probe_base, timing_cfgs = shape.probe(dict(tree), dict(baselines), num_heads, prior)
    probe_tree, probe_base = fill_defaults(kind, probe_tree, probe_base)
    # ---- probe run: acceptance table
    rec = _Recorder(make(probe_tree, probe_base))
    generate(target, rec, calib.prompts[0], 8, ())  # untimed warm-up (lazy inits, allocator)
    rec.runs, rec.steps, rec.seq = [], [], []
    eos = set(int(e) for e in eos)
    for p in calib.prompts:
        generate(target, rec, p, new_tokens, eos)
    D, R, miss = shape.table_dims(probe_tree, probe_base)
    records = rec.records(D)
    table, trials, hits = acceptance_table(records, D, R, miss)
    # ---- timing: probe + a few configs of the draft-cost knob + plain, round-robin through the decoding loop
    runs: list[tuple[dict[str, Any], Any]] = [({"probe": True}, rec.inner)]
    for tc, bc in timing_cfgs:
        tc, bc = fill_defaults(kind, tc, bc)
        runs.append((shape.timing_label(tc, bc), make(tc, bc)))
    runs.append(({"plain": True}, NoDrafter()))
    *timings, plain = time_drafters(target, runs, calib.prompts, timing_tokens)
    book = _book_line(timings + [plain])
    draft_ms = shape.draft_ms_model(timings, probe_tree, probe_base)
    t_verify = anchored_verify(profile, timings + [plain])
    # ---- candidates
    cands = shape.candidates(table, tree, D, num_heads)
    t1 = profile["t1_ms"]
    plain_ms = t_verify(1) + plain.draft_ms + book(1)
    widths = shape.step_widths(records)

    def cost(c: Candidate) -> tuple[float, float, float]:
        if widths:  # proposals are often shorter than the cap (prompt lookup): average over the probe's steps
            k = int(c.draft_key)
            ws = [min(n, k) + 1 for n in widths] or [1]
            tv = float(np.mean([t_verify(w) for w in ws]))
            return tv, draft_ms(c), book(float(np.mean(ws)))
        return t_verify(c.width), draft_ms(c), book(c.width)

    scored = []
    for c in cands:
        tv, td, tb = cost(c)
        scored.append((c.expected * plain_ms / (tv + td + tb), c, tv, td, tb))
    if not scored:
        raise ValueError(f"tree=auto found no candidate tree for {kind} (free knobs {free}, tree {tree})")
    scored.sort(key=lambda s: -s[0])

    def describe(s: tuple) -> dict[str, Any]:
        sp, c, tv, td, tb = s
        knobs = {k: v for k, v in c.knobs.items() if k != "paths"}
        return {**knobs, "tree_size": round(c.width, 3), "expected_tokens": round(c.expected, 4),
                "t_verify_ms": round(tv, 3), "t_draft_ms": round(td, 3), "bookkeeping_ms": round(tb, 3),
                "modeled_speedup": round(sp, 4)}

    best = scored[0]
    chosen = dict(best[1].knobs)
    narrow = next((c for _, c, *_ in scored if c.width <= NARROW), None)  # the best cheap tree, for the branch stage
    out_tree, out_base = fill_defaults(kind, tree, baselines, {k: v for k, v in chosen.items() if k in free
                                                                or k == "paths"})
    shape.finish(out_tree, chosen)
    t_def, b_def = fill_defaults(kind, tree, baselines)
    default = next((x for x in scored if shape.is_default(x[1].knobs, t_def, b_def)), None)  # for the report
    report = {"select": "auto", "family": kind, "free": free, "chosen": describe(best),
              "paths": chosen.get("paths"), "default": describe(default) if default else None,
              "runners_up": [describe(s) for s in scored[1:6]],
              "narrow": ({k: v for k, v in narrow.knobs.items() if k in free or k == "paths"}
                         if narrow is not None and narrow is not best[1] else None),
              "plain_step_ms": round(plain_ms, 3), "t1_ms": t1,
              "calibration": {"questions": calib.question_ids, "source": calib.source, "prompts": len(calib.prompts),
                              "taken_from_eval": calib.taken_from_eval, "steps": len(records),
                              "new_tokens": new_tokens, "probe": shape.probe_desc(probe_tree, probe_base)},
              "table": [[round(x, 4) for x in row] for row in table.tolist()],
              "trials": trials.tolist(),
              "timings": [{**t.config, "width": round(t.width, 2), "draft_ms": round(t.draft_ms, 3),
                           "bookkeeping_ms": round(t.bookkeeping_ms, 3), "target_ms": round(t.target_ms, 3),
                           "steps": t.steps} for t in timings + [plain]],
              "profile": {"t1_ms": t1, "context": profile.get("context"), "cache": profile.get("cache")},
              "t_verify_ms": {w: round(t_verify(w), 3) for w in (1, 2, 4, 8, 16, 32, 64)},
              "seconds": round(time.perf_counter() - t0, 1)}
    log.info("tree=auto %s: %s (E[acc+1] %.3f, modeled %.2fx plain) in %.0f s", kind, report["chosen"],
             best[1].expected, best[0], report["seconds"])
    return out_tree, out_base, report


def timing_sources(n_trees: int, lengths: Sequence[int]) -> list[int]:
    """For each (head tree, branch length) config, tree-major, the config whose draft timing it takes.

    Itself without the branch, else its own tree's longest branch: the branch costs its lookup search at any
    length > 0, while its width is priced by the verification model."""
    longest = list(lengths).index(max(lengths))
    return [j if lengths[j % len(lengths)] == 0 else (j // len(lengths)) * len(lengths) + longest
            for j in range(n_trees * len(lengths))]


def choose_lookup_branch(make: Callable[[dict[str, Any], dict[str, Any]], Any], target: Any,
                         trees: Sequence[dict[str, Any]], baselines: dict[str, Any], calib: Calibration,
                         profile: dict[str, Any], new_tokens: int, timing_tokens: int, eos: Iterable[int],
                         report: dict[str, Any], lengths: Sequence[int] = LOOKUP_BRANCH,
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Choose ``tree.lookup_branch`` (and which of the head ``trees`` carries it): the most modeled tokens/s.

    A merged tree's E[accepted + 1] is not a product of per-depth tables (the copied branch is right or wrong
    as a whole, and shares nodes with the head's guess), so it is measured: each (head tree, length) decodes
    the calibration prompts through the real loop. Costs come from the same model as the head's tree: the
    anchored profile at each step's own width, the draft ms per step (timed per head tree without the branch and
    with the longest; shorter branches cost the same lookup search), bookkeeping as a line in the width.
    ``report`` (the head stage's, {} when no head knob was free) gains ``lookup_branch``; its ``chosen`` entry
    becomes the merged tree's numbers (``head_only`` keeps the head stage's)."""
    eos = set(int(e) for e in eos)
    configs = [{**t, "lookup_branch": n} for t in trees for n in lengths]
    runs = [({"lookup_branch": c["lookup_branch"]}, make(c, baselines)) for c in configs]
    generate(target, runs[0][1], calib.prompts[0], 8, ())  # untimed warm-up
    acc: list[list[int]] = [[] for _ in runs]
    widths: list[list[int]] = [[] for _ in runs]
    for (_, d), a, w in zip(runs, acc, widths):
        for p in calib.prompts:
            res = generate(target, d, p, new_tokens, eos)
            a.extend(res.accepted)
            w.extend(res.tree_sizes)
    # Timed: per head tree, without the branch and with the longest one. The branch's draft cost is the lookup
    # search, the same at any length > 0 (its width is priced by the verification model), so the other lengths
    # take the longest one's draft time instead of a timing run of their own.
    source = timing_sources(len(trees), lengths)
    timed = sorted(set(source))
    *measured, plain = time_drafters(target, [runs[j] for j in timed] + [({"plain": True}, NoDrafter())],
                                     calib.prompts, timing_tokens)
    by_config = dict(zip(timed, measured))
    timings = [by_config[source[j]] for j in range(len(configs))]
    book = _book_line(measured + [plain])
    t_verify = anchored_verify(profile, measured + [plain])
    plain_ms = t_verify(1) + plain.draft_ms + book(1)
    rows = []
    keys = [k for k in ("size", "top_k", "depth", "nodes") if k in (report.get("chosen") or {})]  # the head's knobs
    for c, a, w, t in zip(configs, acc, widths, timings):
        tau = tau_value(sum(a), len(a))
        tv = float(np.mean([t_verify(x) for x in w])) if w else t_verify(1)
        tb = book(float(np.mean(w)) if w else 1.0)
        knobs = {k: c[k] for k in keys}
        rows.append({**knobs, "lookup_branch": c["lookup_branch"],
                     "tree_size": round(float(np.mean(w)) if w else 1.0, 3), "expected_tokens": round(tau, 4),
                     "t_verify_ms": round(tv, 3), "t_draft_ms": round(t.draft_ms, 3), "bookkeeping_ms": round(tb, 3),
                     "modeled_speedup": round(tau * plain_ms / (tv + t.draft_ms + tb), 4), "steps": len(a)})
    i = max(range(len(rows)), key=lambda j: rows[j]["modeled_speedup"])
    best = configs[i]
    report = {**report, "select": "auto", "free": list(report.get("free", [])) + ["lookup_branch"],
              "head_only": report.get("chosen"), "chosen": rows[i], "paths": best.get("paths"),
              "lookup_branch": {"lengths": list(lengths),
                                "timed_lengths": sorted({configs[j]["lookup_branch"] for j in timed}), "rows": rows,
                                "plain_step_ms": round(plain_ms, 3), "prompts": len(calib.prompts),
                                "new_tokens": new_tokens}}
    log.info("tree=auto lookup_branch: %s (measured E[acc+1] %.3f, modeled %.2fx plain)", tree_label(rows[i]),
             rows[i]["expected_tokens"], rows[i]["modeled_speedup"])
    return best, report


def ratio(measured: float | None, modeled: float | None) -> float | None:
    """measured / modeled speedup (1.0 = the model was exact)."""
    if not measured or not modeled or not math.isfinite(modeled):
        return None
    return round(measured / modeled, 4)


# --------------------------------------------------------------------------------------------
# Entry-point glue (eval/acceptance.py, eval/measure.py)
# --------------------------------------------------------------------------------------------

def configure(kind: str, target: Any, tree: dict[str, Any], baselines: dict[str, Any],
              make: Callable[[dict[str, Any], dict[str, Any]], Any], calibration: Callable[[], Calibration],
              profile: Callable[[], dict[str, Any]], checkpoint: str | None = None, untrained_heads: int = 4,
              eos: Iterable[int] = ()) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Concrete (tree, baselines) for ``kind``: explicit knobs kept, free ones chosen (tree=auto) or defaulted.

    ``calibration`` and ``profile`` are called only when something is chosen. Returns the choice report
    ({} when nothing was chosen).
    """
    free = free_knobs(kind, tree, baselines)
    if not free:
        t, b = fill_defaults(kind, tree, baselines)
        return t, b, {}
    cal = tree.get("calibration") or {}
    new_tokens = int(cal.get("max_new_tokens") or 0)
    timing_tokens = int(cal.get("timing_tokens") or 0)
    if new_tokens < 2 or timing_tokens < 2:
        raise ValueError(f"tree.calibration.max_new_tokens={cal.get('max_new_tokens')!r} and timing_tokens="
                         f"{cal.get('timing_tokens')!r} must be >= 2 for tree.select=auto")
    # static-tree heads record their count and rank accuracies, which shape the probe tree
    num_heads, prior = registry.shape_of(kind).head_stats(checkpoint, tree, int(untrained_heads))
    return choose(kind, make, target, tree, baselines, calibration(), profile(), new_tokens, timing_tokens,
                  num_heads, prior, eos)


def tree_label(chosen: dict[str, Any]) -> str:
    """'top_k 4, depth 3, nodes 12 (13 verified)' — the chosen knobs of a choice report, for tables and logs."""
    knobs = [f"{k} {v}" for k, v in chosen.items() if k in ("size", "top_k", "depth", "nodes", "lookup_tokens",
                                                              "draft_tokens", "lookup_branch")]
    return ", ".join(knobs) + f" ({_fmt(chosen.get('tree_size'))} verified)"


def _fmt(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
