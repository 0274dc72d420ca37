"""scripts/compare_families.sh end to end on a tiny random target: distill, every registered family's trainer on one
file and one budget, one fp32 measurement with a head-to-head table."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import run_tree

from draftheads.heads.registry import FAMILIES

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_family_on_one_distilled_file_then_one_measurement(tiny_target_dir, chat_file, tmp_path):
    run = tmp_path / "run"
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) for i, t in
                               enumerate(["hello there how are you", "count one two three four"])) + "\n")
    env = dict(os.environ, RUN=str(run), N="16", SOURCE=str(chat_file), DISTILL_TOKENS="10", STEPS="3", DV="",
               VOCAB_REF=str(chat_file), EAGLE3_ARGS="head.aux_layers=[0,1,2]", QUESTIONS=str(qfile), MAXQ="2",
               NEW="8", PARALLEL="0",
               WANDB_MODE="disabled", DRAFTHEADS_CACHE=str(tmp_path / "cache"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    overrides = ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true", "train.device=cpu",
                 "train.batch_size=2", "train.grad_accum=1", "data.max_length=64", "data.heldout_fraction=0.2",
                 "logging.wandb=disabled"]
    p = run_tree(["bash", str(REPO / "scripts" / "compare_families.sh"), *overrides], timeout=900, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]

    records = [json.loads(line) for line in (run / "distilled.jsonl").read_text().splitlines()]
    e3 = json.loads((run / "eagle3" / "final" / "config.json").read_text())
    assert e3["draft_vocab"]["reference"] == str(chat_file)  # VOCAB_REF reached the EAGLE-3 trainer
    assert len(records) == 16 and all(r["messages"][-1]["role"] == "assistant" for r in records)
    res = json.loads((run / "measure" / "results.json").read_text())
    assert res["dtype"] == "fp32"
    assert list(FAMILIES) == ["medusa", "eagle", "eagle3", "block"] and set(FAMILIES) <= set(res["methods"])
    for fam in FAMILIES:
        summary = json.loads((run / fam / "final" / "config.json").read_text())
        assert summary["family"] == fam
        assert res["methods"][fam]["checkpoint"] == str(run / fam / "final")
        assert (run / fam / ".hydra" / "overrides.yaml").exists()  # Hydra's logs beside the run, not in ./runs
        gi = res["settings"]["greedy"]["greedy_identical"][fam]
        assert gi["identical"] == gi["comparable_turns"] == 2  # fp32: every head reproduces plain greedy
    g = res["settings"]["greedy"]
    pairs = {(q["a"], q["b"]): q for q in g["head_to_head"]}
    assert set(pairs) == {(a, b) for i, a in enumerate(FAMILIES) for b in list(FAMILIES)[i + 1:]}  # 6 pairs
    for (a, b), q in pairs.items():
        assert q["forwards_a"] == g["methods"][a]["steps"] and q["saved"] == q["forwards_a"] - q["forwards_b"]
    assert "Head to head" in (run / "measure" / "report.md").read_text()
    assert f"report: {run}/measure/report.md" in p.stdout


def test_an_unknown_family_is_refused_before_any_work(tmp_path):
    """A typo in FAMILIES: one line naming it and the allowed families, exit 2, before distillation starts."""
    import subprocess

    env = dict(os.environ, RUN=str(tmp_path / "run"), FAMILIES="block eagel3")
    p = subprocess.run(["bash", str(REPO / "scripts" / "compare_families.sh")], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "FAMILIES: 'eagel3'" in p.stderr
    assert set(p.stderr.split("allowed:")[1].split()) == set(FAMILIES)
    assert not (tmp_path / "run").exists()  # nothing distilled, nothing written
