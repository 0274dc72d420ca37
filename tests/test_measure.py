"""The measurement job end to end on a tiny random target: every method, greedy + sampled, latency profile,
tree-size sweep, JSON + markdown + PNGs with sane numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_tau_accounts_for_tokens, compose
from draftheads.eval.measure import main
from draftheads.eval.measure_summary import depth_stats, formula_tau

QUESTIONS = [
    {"question_id": 1, "category": "copy", "turns": ["please list one two three one two three one two", "count from one"]},
    {"question_id": 2, "category": "open", "turns": ["hello there how are you"]},
    {"question_id": 3, "category": "copy", "turns": ["red blue green red blue green red"]},
]


def _overrides(target_dir: Path, qfile: Path, out: Path, *extra: str) -> list[str]:
    return ["target=hf", f"target.name={target_dir}", "target.dtype=fp32", "target.local_files_only=true",
            f"questions={qfile}", "max_new_tokens=16", "temperatures=[1.0]", f"out_dir={out}",
            "methods=[plain,hf_plain,hf_prompt_lookup,prompt_lookup,draft_model,medusa-init]", "baselines.draft_model=self:2",
            "untrained_heads=2", "profile.widths=[1,4,16]", "profile.repeats=1", "sweep.tree_sizes=[4,8]",
            "sweep.chain_sizes=[2,4]", "sweep.max_questions=2", "sweep.max_new_tokens=12", "tree.select=default",
            *extra]


def _medusa_checkpoint(target_dir: Path, out: Path, num_heads: int = 2) -> Path:
    """An (untrained, identity-initialized) Medusa checkpoint for the tiny target: a 'trained head' input."""
    from draftheads.heads.medusa import MedusaHeads, medusa_config_for
    from draftheads.heads.target import load_target

    tgt = load_target({"name": str(target_dir), "dtype": "fp32", "local_files_only": True})
    MedusaHeads(medusa_config_for(tgt, num_heads, 1, True), tgt.lm_head()).save_pretrained(out, tgt.identity)
    return out


@pytest.mark.slow
def test_measure_job_end_to_end(tiny_target_dir, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    out = tmp_path / "measure"
    head = _medusa_checkpoint(tiny_target_dir, tmp_path / "head")
    res = main(compose("measure", _overrides(tiny_target_dir, qfile, out, f"+heads.medusa={head}")))

    for f in ("results.json", "report.md", "tau_by_category.png", "accept_by_depth.png", "speedup_vs_tree_size.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 500, f
    saved = json.loads((out / "results.json").read_text())
    assert set(saved["settings"]) == {"greedy", "T=1"}
    names = ["plain", "hf_plain", "hf_prompt_lookup", "prompt_lookup", "draft_model", "medusa-init", "medusa"]
    for sname, block in saved["settings"].items():
        assert list(block["methods"]) == names
        plain = block["methods"]["plain"]
        assert plain["tau"] == 1.0 and plain["depth"]["accept_at_depth"] == []
        assert block["speedup_vs_plain"]["plain"]["overall"] == 1.0
        for name, s in block["methods"].items():
            assert s["tokens_per_s"] > 0 and s["new_tokens"] > 0, (sname, name)
            rows = [r for r in saved["rows"] if r["method"] == name and r["setting"] == sname]
            assert len(rows) == 4 and sum(r["new_tokens"] for r in rows) == s["new_tokens"], (sname, name)
            if name in ("plain", "hf_plain"):  # nothing drafted: one token per forward
                assert s["tau"] == 1.0, (sname, name)
            elif name == "hf_prompt_lookup":  # transformers' loop: new tokens after the prefill's per forward
                assert s["tau"] == round(sum(r["new_tokens"] - 1 for r in rows) / sum(r["steps"] for r in rows), 4)
            else:
                assert_tau_accounts_for_tokens(s["tau"], rows)
            assert set(s["per_category"]) == {"copy", "open"}
            assert s["target_ms_per_step"] > 0 and s["bookkeeping_ms_per_step"] >= 0
            d = s["depth"]
            if d["accept_at_depth"]:  # P(acc >= d) is non-increasing; the formula tracks the measured τ
                assert all(a >= b for a, b in zip(d["accept_at_depth"], d["accept_at_depth"][1:]))
                assert d["measured_tau"] == pytest.approx(s["tau"], abs=1e-3)
                assert abs(d["formula_tau"] - d["measured_tau"]) < 0.6
    g = saved["settings"]["greedy"]
    # fp32: our speculative methods reproduce plain greedy token for token
    for name in ("prompt_lookup", "draft_model", "medusa-init", "medusa"):
        gi = g["greedy_identical"][name]
        assert gi["comparable_turns"] == 4 and gi["identical"] == 4, (name, gi)
    assert g["methods"]["hf_plain"]["tau"] == 1.0 and g["greedy_identical"]["hf_plain"]["identical"] == 4
    assert g["methods"]["prompt_lookup"]["tau"] > 1.0 and g["methods"]["medusa-init"]["tau"] > 1.0
    assert g["methods"]["draft_model"]["draft_ms_per_step"] > g["methods"]["prompt_lookup"]["draft_ms_per_step"]
    assert g["methods"]["draft_model"]["mean_tree_size"] == 5.0  # 4 drafted tokens + root
    # latency profile and sweep
    prof = saved["latency_profile"]
    assert [p["width"] for p in prof["points"]] == [1, 4, 16] and prof["t1_ms"] > 0
    sw = saved["sweep"]
    assert [p["size"] for p in sw["medusa-init"]] == [4, 8] and [p["size"] for p in sw["prompt_lookup"]] == [2, 4]
    for name, depth in (("medusa-init", 2), ("prompt_lookup", None), ("draft_model", None)):
        for p in sw[name]:  # no step accepts more than the tree is deep: 2 heads, or a chain of size - 1 drafts
            assert 1.0 <= p["tau"] <= 1 + (depth or p["size"] - 1), (name, p)
            assert p["modeled_speedup"] > 0 and p["measured_speedup"] > 0
    assert [p["mean_tree_size"] for p in sw["medusa-init"]] == [4.0, 8.0]  # static trees: every step the full size
    assert saved["headline"]["best"] == "medusa" and saved["headline"]["trained"]  # the only checkpointed head
    assert saved["methods"]["medusa"]["kind"] == "medusa" and saved["methods"]["medusa"]["checkpoint"] == str(head)
    assert [p["size"] for p in sw["medusa"]] == [4, 8]
    md = (out / "report.md").read_text()
    assert "| method | τ | tokens/s | × plain |" in md and "Verification latency profile" in md
    assert "Speedup by tree size" in md and ("✔" in md or "✘" in md)
    assert res["settings"]["greedy"]["methods"]["plain"]["tau"] == 1.0


def test_heads_measured_together_get_a_paired_head_to_head(tiny_target_dir, tmp_path):
    """Every pair of checkpointed heads: forwards on the same turns, B's saving, a bootstrap interval, a verdict."""
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    two = _medusa_checkpoint(tiny_target_dir, tmp_path / "two", 2)
    three = _medusa_checkpoint(tiny_target_dir, tmp_path / "three", 3)
    out = tmp_path / "measure"
    ov = _overrides(tiny_target_dir, qfile, out, f"+heads.m2={two}", f"+heads.m2again={two}", f"+heads.m3={three}")
    ov = [o for o in ov if not o.startswith(("methods=", "temperatures="))]
    res = main(compose("measure", ov + ["methods=[plain]", "temperatures=[]", "sweep.methods=[]"]))
    g = res["settings"]["greedy"]
    pairs = {(p["a"], p["b"]): p for p in g["head_to_head"]}
    assert set(pairs) == {("m2", "m2again"), ("m2", "m3"), ("m2again", "m3")}
    for (a, b), p in pairs.items():
        assert p["rows"] == 4 and p["unequal_turns_skipped"] == 0  # greedy fp32: same tokens, same prompts
        assert p["forwards_a"] == g["methods"][a]["steps"] and p["forwards_b"] == g["methods"][b]["steps"]
        assert p["saved"] == p["forwards_a"] - p["forwards_b"]
        assert p["ci95"][0] <= p["saved"] <= p["ci95"][1]
        assert p["tau_a"] == pytest.approx(g["methods"][a]["tau"], abs=1e-4)
    same = pairs[("m2", "m2again")]  # one checkpoint twice: deterministic, so no difference at all
    assert same["saved"] == 0 and same["ci95"] == [0, 0] and same["verdict"] == "too few questions (3 < 10)"
    assert same["resampled_units"] == 3  # question 1's two turns are resampled as one unit
    md = (out / "report.md").read_text()
    assert "Head to head" in md and "| m2 | m3 | 4 |" in md


@pytest.mark.slow
def test_measure_job_chooses_trees_with_tree_auto(tiny_target_dir, chat_file, tmp_path, cache_env):
    """The default tree.select=auto: each drafter's null knobs are chosen on held-out calibration prompts (data's
    split, not the question file); results and report show the choice, modeled and measured speedup and ratio."""
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    out = tmp_path / "measure"
    ov = [o for o in _overrides(tiny_target_dir, qfile, out) if not o.startswith(("methods=", "temperatures=",
                                                                                   "tree.select="))]
    ov += ["methods=[plain,prompt_lookup,draft_model,medusa-init]", "temperatures=[]", "sweep.methods=[]",
           "data=file", f"data.path={chat_file}", "data.max_length=64", "data.heldout_fraction=0.1",
           f"data.cache_dir={tmp_path / 'data-cache'}", "tree.calibration.questions=2",
           "tree.calibration.max_new_tokens=12", "tree.calibration.timing_tokens=6", "baselines.draft_tokens=3"]
    res = main(compose("measure", ov))
    tc = res["tree_choice"]
    assert set(tc) == {"prompt_lookup", "medusa-init"}  # draft_tokens was given: kept, not chosen
    assert res["methods"]["draft_model"]["tree_size"] == 4 and "tree_select" not in res["methods"]["draft_model"]
    assert res["methods"]["prompt_lookup"]["tree_depth"] == tc["prompt_lookup"]["chosen"]["lookup_tokens"]
    assert res["methods"]["medusa-init"]["tree_size"] == tc["medusa-init"]["chosen"]["size"]
    g = res["settings"]["greedy"]
    for name, c in tc.items():
        assert c["measured_speedup"] == g["speedup_vs_plain"][name]["overall"] and c["measured_tau"] == g["methods"][name]["tau"]
        assert c["measured_over_modeled"] == pytest.approx(c["measured_speedup"] / c["chosen"]["modeled_speedup"], rel=1e-3)
        assert c["calibration"]["source"] != str(qfile) and c["profile"]["t1_ms"] > 0
        assert g["greedy_identical"][name]["identical"] == g["greedy_identical"][name]["comparable_turns"] == 4
    # the job's profile stops at 16 tokens, short of the widest tree considered: the cached full profile is used
    assert tc["medusa-init"]["profile"]["cache"]["path"].startswith(str(cache_env))
    md = (out / "report.md").read_text()
    assert "## Tree choice (tree.select=auto)" in md and "| medusa-init | size " in md
    assert "| prompt_lookup | lookup_tokens " in md


def test_measure_config_errors(tiny_target_dir, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps(QUESTIONS[0]) + "\n")
    with pytest.raises(ValueError, match="unknown method"):
        main(compose("measure", _overrides(tiny_target_dir, qfile, tmp_path / "o", "methods=[plain,nope]")))
    with pytest.raises(ValueError, match="nothing to measure"):
        main(compose("measure", _overrides(tiny_target_dir, qfile, tmp_path / "o", "greedy=false", "temperatures=[]")))


def test_formula_and_depth_stats():
    assert formula_tau(0.8, 4) == pytest.approx(3.3616)  # the seed's table: alpha 0.8, k 4 -> 3.36
    assert formula_tau(1.0, 3) == 4.0 and formula_tau(0.5, 0) == 1.0
    rows = [{"accepted": [0, 1, 2, 2], "tree_depths": [2, 2, 2, 2]}]
    d = depth_stats(rows)
    assert d["accept_at_depth"] == [0.75, 0.5]
    assert d["conditional_accept"] == [0.75, pytest.approx(2 / 3, abs=1e-4)]
    assert d["alpha"] == pytest.approx(5 / 7, abs=1e-4) and d["measured_tau"] == 2.25


def test_question_file_per_category_and_bad_records(tmp_path):
    """per_category keeps the first N of each category in file order; malformed records name file and line."""
    from draftheads.eval.questions import load_questions

    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]}
            for i, c in enumerate(["a", "a", "a", "b", "b", "c"])]
    qf = tmp_path / "q.jsonl"
    qf.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_questions(qf, per_category=2)
    assert [q["question_id"] for q in got] == [0, 1, 3, 4, 5]
    assert [q["question_id"] for q in load_questions(qf, max_questions=3, per_category=1)] == [0, 3, 5]
    assert len(load_questions(qf)) == 6
    with pytest.raises(ValueError, match="per_category"):
        load_questions(qf, per_category=0)
    qf.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"question_id": 9, "turns": []}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:2: field 'turns'"):
        load_questions(qf)


def test_turns_over_max_prompt_tokens_are_counted_not_hidden(tiny_target_dir, tmp_path, caplog):
    """A prompt longer than max_prompt_tokens ends its question; results and report say how many turns went."""
    qs = [{"question_id": 7, "category": "long", "turns": ["word " * 200, "and again"]},
          {"question_id": 8, "category": "short", "turns": ["hello there", "count from one"]}]
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    out = tmp_path / "measure"
    ov = [o for o in _overrides(tiny_target_dir, qfile, out) if not o.startswith(("methods=", "temperatures="))]
    with caplog.at_level("WARNING"):
        res = main(compose("measure", ov + ["methods=[plain,prompt_lookup]", "temperatures=[]", "sweep.methods=[]",
                                            "max_prompt_tokens=300"]))
    g = res["settings"]["greedy"]
    assert g["turns_skipped_long_prompt"] == {"plain": 2, "prompt_lookup": 2}  # question 7's both turns
    for m in ("plain", "prompt_lookup"):
        assert {(r["question_id"], r["turn"]) for r in res["rows"] if r["method"] == m} == {(8, 0), (8, 1)}
        assert f"greedy/{m}: question 7 turn 1 skipped" in caplog.text
    assert "word" not in caplog.text  # ids and lengths only, never the text
    md = (out / "report.md").read_text()
    assert "longer than max_prompt_tokens=300 (a question's later turns go with it): plain 2, prompt_lookup 2." in md
