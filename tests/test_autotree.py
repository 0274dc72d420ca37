"""tree=auto: E[accepted + 1 | tree] from acceptance tables (closed forms, brute force), the table estimate
from recorded trees, the best-first tree order, knob validation, the calibration split, the latency-profile
cache, and the eval job choosing a tree end to end on a tiny target."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import compose
from draftheads.eval.autotree import timing_sources, tree_label
from draftheads.eval.autotree_knobs import explicit_knob, fill_defaults, free_knobs
from draftheads.eval.calibration import acceptance_table, calibration_split
from draftheads.eval.trees import chain, expected_tokens, greedy_tree_order, static_tree


def _e(tree, table) -> float:
    return expected_tokens(tree.parents, tree.depths, tree.ranks, torch.as_tensor(table, dtype=torch.float64))


def _brute_force(paths, table) -> float:
    """E[accepted + 1] by enumerating every outcome: per depth the target's token is rank r (prob table[d][r]) or
    none of the candidates (the rest); accepted = the longest prefix of the outcome that is a tree path."""
    D, R = len(table), len(table[0])
    tree = {tuple(p) for p in paths}
    total = 0.0
    for outcome in itertools.product(range(R + 1), repeat=D):  # R = "not a candidate"
        p = 1.0
        for d, r in enumerate(outcome):
            p *= table[d][r] if r < R else 1.0 - sum(table[d])
        acc = 0
        while acc < D and outcome[acc] < R and tuple(outcome[:acc + 1]) in tree:
            acc += 1
        total += p * (acc + 1)
    return total


def test_lookup_branch_lengths_take_their_own_trees_longest_timing():
    # three head trees x lengths [0, 3, 6, 16], tree-major: length 0 is timed itself, the others borrow the
    # timing of the same tree's 16-token branch (never another tree's)
    assert timing_sources(3, [0, 3, 6, 16]) == [0, 3, 3, 3, 4, 7, 7, 7, 8, 11, 11, 11]
    assert timing_sources(2, [6, 0, 16]) == [2, 1, 2, 5, 4, 5]  # order-free: the longest wherever it sits
    assert timing_sources(1, [0]) == [0]


def test_chain_gives_the_closed_form():
    for alpha in (0.0, 0.3, 0.8):
        for k in (1, 3, 6):
            table = [[alpha, 0.1] for _ in range(k)]
            assert _e(chain(k), table) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_nodes_outside_the_table_count_nothing():
    table = [[0.5], [0.5]]  # depth 2, one rank
    t = static_tree([(0,), (1,), (0, 0), (0, 0, 0)])  # rank 1 and depth 3 are unmeasured
    assert _e(t, table) == pytest.approx(1 + 0.5 + 0.25)


@st.composite
def _tree_and_table(draw):
    D = draw(st.integers(1, 3))
    R = draw(st.integers(1, 3))
    table = []
    for _ in range(D):
        row = draw(st.lists(st.floats(0.0, 1.0), min_size=R, max_size=R))
        s = sum(row)
        table.append([x / s * draw(st.floats(0.0, 1.0)) if s > 0 else 0.0 for x in row])  # Σ_r ≤ 1
    all_paths = [p for d in range(1, D + 1) for p in itertools.product(range(R), repeat=d)]
    chosen = draw(st.lists(st.sampled_from(all_paths), min_size=1, max_size=12))
    closed = {p[:i] for p in chosen for i in range(1, len(p) + 1)}  # prefix-closed
    return sorted(closed), table


@settings(max_examples=60, deadline=None)
@given(_tree_and_table())
def test_expectation_equals_brute_force_enumeration(case):
    paths, table = case
    assert _e(static_tree(paths), table) == pytest.approx(_brute_force(paths, table), abs=1e-9)


def _trees(D: int, R: int, n: int, rank_closed: bool):
    """Every tree of n non-root nodes: prefix-closed, and rank-closed if asked (rank r only after rank r-1)."""
    all_paths = [p for d in range(1, D + 1) for p in itertools.product(range(R), repeat=d)]
    for combo in itertools.combinations(all_paths, n):
        s = set(combo)
        if all((len(p) == 1 or p[:-1] in s) and (not rank_closed or p[-1] == 0 or p[:-1] + (p[-1] - 1,) in s)
               for p in s):
            yield combo


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("rank_closed", [True, False])
def test_best_first_order_is_the_best_tree_of_every_size(n, rank_closed):
    table = [[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.7, 0.1, 0.05]]  # decreasing in rank, as drafters' ranks are
    if not rank_closed:  # a static tree may skip ranks: then the table need not decrease
        table = [[0.1, 0.5, 0.1], [0.6, 0.2, 0.1], [0.7, 0.1, 0.3]]
    order, probs = greedy_tree_order(torch.tensor(table), n, rank_closed=rank_closed)
    assert len(order) == n and all(a >= b for a, b in zip(probs, probs[1:]))
    best = max(_brute_force(c, table) for c in _trees(3, 3, n, rank_closed))
    assert _e(static_tree(order), table) == pytest.approx(best) == pytest.approx(1 + sum(probs))


def test_best_first_order_honours_depth_rank_and_expansion_limits():
    table = torch.tensor([[0.6, 0.3, 0.05], [0.6, 0.3, 0.05], [0.6, 0.3, 0.05]])
    order, _ = greedy_tree_order(table, 20, max_depth=2, top_k=2)
    assert max(len(p) for p in order) == 2 and max(max(p) for p in order) == 1 and len(order) == 6
    order, _ = greedy_tree_order(table, 20, expand_per_depth=1)  # EAGLE-2 with top_k 1 per depth expanded
    for d in (1, 2):
        assert len({p[:-1] for p in order if len(p) == d + 1}) <= 1
    order, _ = greedy_tree_order(torch.tensor([[0.5, 0.0], [0.0, 0.0]]), 10)
    assert order == [(0,)]  # zero-probability nodes are never added


# ------------------------------------------------------------------------------------------ the table estimate

def test_chain_table_telescopes_to_mean_accepted():
    """Chains (absent child = miss): E from the table = 1 + mean(min(accepted, k)) for every k, exactly."""
    rng = torch.Generator().manual_seed(0)
    records, accepted = [], []
    for _ in range(200):
        cont = torch.randint(0, 5, (8,), generator=rng).tolist()
        n = int(torch.randint(0, 7, (1,), generator=rng))  # proposal length
        prop = [c if torch.rand(1, generator=rng) < 0.7 else 99 for c in cont[:n]]  # 99 never matches
        a = next((i for i, (x, y) in enumerate(zip(prop, cont)) if x != y), len(prop))
        accepted.append(a)
        records.append((list(range(-1, n)), [7] + prop, cont))  # a chain: node i's parent is i-1
    table, trials, hits = acceptance_table(records, 6, 1, absent_is_miss=True)
    assert trials[0, 0] == 200 and hits[0, 0] == sum(a >= 1 for a in accepted)
    for k in range(1, 7):
        want = 1 + sum(min(a, k) for a in accepted) / len(accepted)
        assert _e(chain(k), table) == pytest.approx(want)


def test_tree_table_counts_ranks_hazard_style():
    # root 0 with children [1: tok 10, 2: tok 11]; node 1 has children [3: tok 20]; node 2 has none
    parents, tokens = [-1, 0, 0, 1], [5, 10, 11, 20]
    records = [(parents, tokens, [10, 20, 1]),  # rank 0 then rank 0, then depth 3 unobserved (no children)
               (parents, tokens, [11, 30]),  # rank 1 at depth 1; node 2 was not expanded: depth 2 unobserved
               (parents, tokens, [12]),  # miss at depth 1: ranks 0 and 1 are known misses
               (parents, tokens, [10, 21])]  # depth 2: rank 0 missed; rank 1 was not drafted: unobserved
    table, trials, hits = acceptance_table(records, 3, 2, absent_is_miss=False)
    assert trials.tolist() == [[4, 2], [2, 0], [0, 0]] and hits.tolist() == [[2, 1], [1, 0], [0, 0]]
    h0, h1 = 2 / 4, 1 / 2
    assert table[0].tolist() == pytest.approx([h0, h1 * (1 - h0)])  # P(rank 1) = h1 · P(not rank 0)
    assert table[1].tolist() == pytest.approx([0.5, 0.0]) and table[2].tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------ knobs

def test_null_knobs_are_free_and_explicit_ones_win():
    tree = {"select": "auto", "kind": "auto", "top_k": None, "depth": 4, "nodes": None, "size": None, "paths": None,
            "lookup_branch": 0}
    base = {"lookup_tokens": None, "draft_tokens": 3}
    assert free_knobs("eagle", tree, base) == ["top_k", "nodes"]
    assert free_knobs("medusa", tree, base) == ["size"]
    assert free_knobs("medusa", {**tree, "size": 16}, base) == []
    assert free_knobs("medusa", {**tree, "paths": [[0]]}, base) == []
    assert free_knobs("eagle3", {**tree, "kind": "chain", "depth": None}, base) == ["depth"]
    # a trained head's lookup branch is chosen too when null; baselines never get one
    assert free_knobs("medusa", {**tree, "size": 16, "lookup_branch": None}, base) == ["lookup_branch"]
    assert free_knobs("eagle", {**tree, "lookup_branch": None}, base) == ["top_k", "nodes", "lookup_branch"]
    assert free_knobs("prompt_lookup", {**tree, "lookup_branch": None}, base) == ["lookup_tokens"]
    assert free_knobs("prompt_lookup", tree, base) == ["lookup_tokens"] and free_knobs("draft_model", tree, base) == []
    assert free_knobs("plain", tree, base) == [] and free_knobs("medusa", {**tree, "select": "default"}, base) == []
    t, b = fill_defaults("eagle", tree, base, {"top_k": 3})
    assert (t["top_k"], t["depth"], t["nodes"], t["size"], b["lookup_tokens"], b["draft_tokens"]) == (3, 4, 60, 64, 10, 3)
    assert fill_defaults("eagle", {**tree, "lookup_branch": None}, base)[0]["lookup_branch"] == 0  # default: off


@pytest.mark.parametrize("key,value", [("nodes", 0), ("top_k", -1), ("depth", 0), ("size", 1), ("nodes", "many"),
                                       ("depth", 2.5), ("size", True), ("lookup_branch", -1)])
def test_zero_negative_and_non_integer_knobs_are_errors(key, value):
    tree = {"select": "auto", key: value}
    with pytest.raises(ValueError, match=rf"tree\.{key}="):
        free_knobs("eagle", tree, {})
    with pytest.raises(ValueError, match=r"baselines\.lookup_tokens=0"):
        free_knobs("prompt_lookup", {"select": "auto"}, {"lookup_tokens": 0})
    with pytest.raises(ValueError, match="tree.select"):
        free_knobs("medusa", {"select": "fastest"}, {})
    assert explicit_knob({"nodes": "12"}, "nodes", "tree") == 12


def test_calibration_never_uses_measured_questions(tmp_path):
    qs = [{"question_id": f"q{i}", "turns": [f"question {i}"]} for i in range(6)]
    to_ids = lambda q: [int(q["question_id"][1:])] * 3  # noqa: E731
    held, other = tmp_path / "heldout.jsonl", tmp_path / "mt_bench.jsonl"
    held.touch()
    other.touch()
    # another question file: the held-out split's last questions
    ev, cal = calibration_split(qs, held, other, qs[:2], 2, to_ids)
    assert ev == qs[:2] and cal.question_ids == ["q5", "q4"] and cal.prompts == [[5] * 3, [4] * 3]
    # the held-out split itself, first 3 measured: calibration from the other 3
    ev, cal = calibration_split(qs, held, held, qs[:3], 2, to_ids)
    assert ev == qs[:3] and cal.question_ids == ["q5", "q4"] and cal.taken_from_eval == 0
    # the whole split measured: the last eval questions move to calibration, never both
    ev, cal = calibration_split(qs, held, held, qs, 2, to_ids)
    assert [q["question_id"] for q in ev] == ["q0", "q1", "q2", "q3"] and cal.question_ids == ["q5", "q4"]
    assert cal.taken_from_eval == 2 and not {q["question_id"] for q in ev} & set(cal.question_ids)
    # over-long prompts are skipped
    ev, cal = calibration_split(qs, held, other, qs, 2, lambda q: [0] * (10 if q["question_id"] == "q5" else 3), 5)
    assert cal.question_ids == ["q4", "q3"]
    with pytest.raises(ValueError, match="tree.select=default"):
        calibration_split(qs[:1], held, held, qs[:1], 2, to_ids)


def test_tree_label_names_the_chosen_knobs():
    assert tree_label({"top_k": 4, "depth": 3, "nodes": 12, "tree_size": 13, "expected_tokens": 1.9}) == \
        "top_k 4, depth 3, nodes 12 (13 verified)"


def test_verification_time_is_the_profile_scaled_to_the_loops_own_forwards():
    from draftheads.eval.autotree_model import anchored_verify
    from draftheads.eval.calibration import Timing

    prof = {"points": [{"width": w, "ms": 99.0, "ms_min": m} for w, m in ((1, 40.0), (4, 44.0), (16, 60.0), (64, 120.0))]}
    loop = [Timing({}, 1.0, 0, 0, 50.0, 10), Timing({}, 64.0, 0, 0, 120.0, 10), Timing({}, 9.0, 0, 0, 0.0, 0)]
    tv = anchored_verify(prof, loop)  # scale 1.25 at width 1, 1.0 at 64, log-linear between; unrun configs ignored
    assert tv(1) == pytest.approx(50.0) and tv(64) == pytest.approx(120.0)
    assert tv(8) == pytest.approx((44 + 16 * 4 / 12) * (1.25 - 0.25 * 3 / 6)) and tv(128) == pytest.approx(120.0)
    assert anchored_verify(prof, [])(4) == 99.0  # no loop timing: the profile's medians

# ------------------------------------------------------------------------------------------ latency cache

def test_verification_time_never_falls_with_width():
    from draftheads.eval.latency import monotone, t_verify_ms

    assert monotone([1, 3, 2, 4]) == [1, 2.5, 2.5, 4] and monotone([5, 1, 1]) == [7 / 3] * 3
    assert monotone([1, 2, 3]) == [1, 2, 3]
    prof = {"points": [{"width": 1, "ms": 50.0}, {"width": 4, "ms": 40.0}, {"width": 16, "ms": 80.0}]}  # noisy t(4)
    assert t_verify_ms(prof, 1) == t_verify_ms(prof, 4) == 45.0 and t_verify_ms(prof, 10) == pytest.approx(62.5)


def test_latency_profile_is_cached_per_key(tiny_target_dir, cache_env):
    from draftheads.eval.latency import cached_latency_profile, profile_path, profile_key
    from draftheads.heads.target import load_target

    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})
    a = cached_latency_profile(tgt, (1, 4), 16, 1)
    assert not a["cache"]["from_cache"] and Path(a["cache"]["path"]).is_file()
    assert str(cache_env) in a["cache"]["path"] and [p["width"] for p in a["points"]] == [1, 4]
    b = cached_latency_profile(tgt, (1, 4), 16, 1)
    assert b["cache"]["from_cache"] and b["points"] == a["points"]
    key = profile_key(tgt, (1, 4), 16, 1)
    assert key["threads"] == torch.get_num_threads() and key["torch"] == torch.__version__
    assert key["dtype"] == "fp32" and key["target"]["fingerprint"] == tgt.identity.fingerprint
    assert profile_path({**key, "threads": key["threads"] + 1}) != profile_path(key)
    c = cached_latency_profile(tgt, (1, 2, 4), 16, 1)  # another shape: measured anew
    assert not c["cache"]["from_cache"]


# ------------------------------------------------------------------------------------------ end to end

def _eval_overrides(tiny_target_dir, chat_file, tmp_path, *extra):
    return ["target=hf", f"target.name={tiny_target_dir}", "target.dtype=fp32", "target.local_files_only=true",
            "data=file", f"data.path={chat_file}", "data.max_length=64", "data.heldout_fraction=0.1",
            f"data.cache_dir={tmp_path / 'data-cache'}", "max_questions=3", "max_turns=1", "max_new_tokens=16",
            "compare_plain=true", f"out={tmp_path / 'eval.json'}", "tree.calibration.questions=2",
            "tree.calibration.max_new_tokens=16", "tree.calibration.timing_tokens=6", *extra]


@pytest.mark.slow
def test_acceptance_job_chooses_the_tree_and_reports_model_vs_measurement(tiny_target_dir, chat_file, tmp_path,
                                                                          cache_env):
    from draftheads.eval.acceptance import main

    res = main(compose("eval", _eval_overrides(tiny_target_dir, chat_file, tmp_path, "drafter=medusa-init",
                                               "untrained_heads=2")))
    c = res["tree_choice"]
    assert res["drafter"]["tree_select"] == "auto" and res["drafter"]["tree_source"] == "auto"
    assert c["free"] == ["size", "lookup_branch"] and 2 <= c["chosen"]["size"] <= 64
    lb = c["lookup_branch"]  # the branch measured on top of the chosen head tree, the best modeled one kept
    assert lb["lengths"] == [0, 3, 6, 10, 16]
    heads = 1 + (c["narrow"] is not None)  # the head's best tree, and the best of <= 8 nodes when that differs
    assert [r["lookup_branch"] for r in lb["rows"]] == lb["lengths"] * heads
    n = len(lb["lengths"])
    assert [r["size"] for r in lb["rows"][:n]] == [c["head_only"]["size"]] * n
    if c["narrow"]:
        assert [r["size"] for r in lb["rows"][n:]] == [c["narrow"]["size"]] * n and c["narrow"]["size"] <= 8
    # timed without the branch and with the longest; every length > 0 of a tree carries the longest one's draft time
    assert lb["timed_lengths"] == [0, 16]
    for t in range(heads):
        rows = lb["rows"][t * n:(t + 1) * n]
        assert len({r["t_draft_ms"] for r in rows if r["lookup_branch"] > 0}) == 1
    assert c["chosen"] == max(lb["rows"], key=lambda r: r["modeled_speedup"])
    assert res["drafter"].get("lookup_branch", 0) == c["chosen"]["lookup_branch"]
    assert res["drafter"]["tree_size"] == c["chosen"]["size"] == len(c["paths"]) + 1
    assert max(len(p) for p in c["paths"]) <= 2  # two heads
    assert c["head_only"]["modeled_speedup"] >= max(r["modeled_speedup"] for r in c["runners_up"])
    # measured E[accepted + 1] of the merged tree: at most one plus its depth (the heads' paths or the branch)
    depth = max(max(len(p) for p in c["paths"]), c["chosen"]["lookup_branch"])
    assert 1.0 <= c["chosen"]["expected_tokens"] <= 1 + depth and c["calibration"]["steps"] > 0
    assert c["measured_over_modeled"] == pytest.approx(c["measured_speedup"] / c["chosen"]["modeled_speedup"], rel=1e-3)
    assert not set(c["calibration"]["questions"]) & {r["question_id"] for r in res["rows"]}  # never the eval questions
    gi = res["greedy_identical"]
    assert gi["identical"] == gi["turns"] == 3  # fp32: exact whatever the tree; max_questions=3, one turn each
    assert json.loads((tmp_path / "eval.json").read_text())["tree_choice"]["chosen"] == c["chosen"]
    assert c["profile"]["cache"]["path"].startswith(str(cache_env))
    # an explicit tree.size wins (only the branch is chosen); with tree.lookup_branch too, no calibration at all
    res = main(compose("eval", _eval_overrides(tiny_target_dir, chat_file, tmp_path, "drafter=medusa-init",
                                               "untrained_heads=2", "tree.size=5")))
    assert res["tree_choice"]["free"] == ["lookup_branch"] and res["drafter"]["tree_size"] == 5
    res = main(compose("eval", _eval_overrides(tiny_target_dir, chat_file, tmp_path, "drafter=medusa-init",
                                               "untrained_heads=2", "tree.size=5", "tree.lookup_branch=0")))
    assert "tree_choice" not in res and res["drafter"]["tree_size"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("drafter,knob", [("prompt_lookup", "lookup_tokens"), ("eagle", "nodes")])
def test_acceptance_job_chooses_chains_and_dynamic_trees(tiny_target_dir, chat_file, tmp_path, cache_env, drafter,
                                                         knob):
    from draftheads.eval.acceptance import main

    extra = [f"drafter={drafter}"]
    if drafter == "eagle":
        from draftheads.heads.eagle import EagleDraft, eagle_config_for
        from draftheads.heads.target import load_target

        tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})
        torch.manual_seed(0)
        EagleDraft(eagle_config_for(tgt), tgt).save_pretrained(tmp_path / "d", tgt.identity)
        extra += [f"checkpoint={tmp_path / 'd'}", "tree.depth=3"]  # a fixed knob stays fixed
    res = main(compose("eval", _eval_overrides(tiny_target_dir, chat_file, tmp_path, *extra)))
    c = res["tree_choice"]
    assert knob in c["chosen"] and c["chosen"][knob] >= 1
    if drafter == "eagle":
        assert c["free"] == ["top_k", "nodes", "lookup_branch"] and c["chosen"]["depth"] == 3 and res["drafter"]["tree_depth"] == 3
        assert res["drafter"]["tree_size"] == c["chosen"]["nodes"] + 1 and res["drafter"]["tree_top_k"] == c["chosen"]["top_k"]
        assert len(c["table"]) == 3 and all(t["draft_ms"] >= 0 for t in c["timings"])
    else:
        assert res["drafter"]["tree_depth"] == c["chosen"]["lookup_tokens"] and len(c["table"][0]) == 1
    assert res["greedy_identical"]["identical"] == res["greedy_identical"]["turns"] == 3  # max_questions=3, one turn
    assert math.isfinite(c["measured_over_modeled"])
