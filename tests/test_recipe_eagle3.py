"""scripts/recipe_eagle3.sh end to end on a tiny random target: distill every turn, train EAGLE-3 with τ-selected
checkpoints, measure best/ against plain decoding, publish a Hub-layout folder; a rerun resumes every stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_tau_accounts_for_tokens, deepest_draft, run_tree

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_recipe_runs_every_stage_and_resumes(tiny_target_dir, chat_file, tmp_path):
    run = tmp_path / "run"
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                               enumerate([("a", "hello there how are you"), ("b", "count one two three four")])) + "\n")
    env = dict(os.environ, RUN=str(run), N="12", TURNS="all", SOURCE=str(chat_file), DISTILL_TOKENS="8", STEPS="4", TAU_EVERY="2",
               QUESTIONS=str(qfile), MAXQ="2", NEW="8",
               EAGLE3_ARGS="head.aux_layers=[0,1,2] head.draft_vocab_size=64 train.tau_eval.evaluator.prompts=2",
               DISTILL_ARGS="decode_attention=sdpa",  # not the fp32 default (matmul): shows the overrides reach distill
               DISTILL_PROCS="2",  # torchrun: two shard processes, merged into distilled.jsonl
               FAMILIES="eagle3 medusa", MEDUSA_ARGS="head.num_heads=2 train.tau_eval.evaluator.prompts=2",
               WANDB_MODE="disabled", DRAFTHEADS_CACHE=str(tmp_path / "cache"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    overrides = ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true", "train.device=cpu",
                 "train.batch_size=2", "train.grad_accum=1", "data.max_length=64", "data.heldout_fraction=0.2",
                 "logging.wandb=disabled"]
    cmd = ["bash", str(REPO / "scripts" / "recipe_eagle3.sh"), *overrides]
    p = run_tree(cmd, timeout=900, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]

    records = [json.loads(line) for line in (run / "distilled.jsonl").read_text().splitlines()]
    assert records and all(r["messages"][-1]["role"] == "assistant" for r in records)
    shards = [[json.loads(x) for x in (run / f"distilled.shard{i}of2.jsonl").read_text().splitlines()] for i in (0, 1)]
    assert all(shards) and shards[0] + shards[1] == records  # both processes wrote, merged in shard order
    logs = {i: (run / "distilled.jsonl.hydra" / f"distill.rank{i}.log").read_text() for i in (0, 1)}
    assert all(f'"shard": "{i}/2"' in logs[i] and f'"shard": "{1 - i}/2"' not in logs[i] for i in (0, 1))  # one log each
    best = json.loads((run / "eagle3" / "best" / "best.json").read_text())
    assert best["step"] in (2, 4)
    out = json.loads((run / "recipe.json").read_text())
    bench = json.loads((run / "benchmark.json").read_text())
    assert out["tau"] == bench["summary"]["tau"]
    assert_tau_accounts_for_tokens(bench["summary"]["tau"], bench["rows"], deepest_draft(bench["drafter"]))
    assert out["turns"] == 2 and out["greedy_identical"] == 2  # fp32: the head reproduces plain greedy
    assert out["total_s"] >= out["train_s"] >= 0
    assert set(out["speedup_vs_plain"]) == {"plain", "prompt_lookup", "eagle3", "medusa"} and out["speedup_vs_plain"]["plain"] == 1.0
    assert out["tree_choice"]
    measured = json.loads((run / "measure" / "results.json").read_text())
    assert out["tau_measure"] == {k: v["tau"] for k, v in measured["settings"]["greedy"]["methods"].items()}
    assert out["tau_measure"]["plain"] == 1.0
    for name in ("prompt_lookup", "eagle3", "medusa"):
        assert_tau_accounts_for_tokens(out["tau_measure"][name], [r for r in measured["rows"] if r["method"] == name
                                                                  and r["setting"] == "greedy"])
    assert out["data"]["conversations"] == len(records) == out["data"]["last_distill_job"]["written"]
    assert out["data"]["last_distill_job"]["decode_attention"] == "sdpa"
    assert out["train"]["head"].endswith("best") and out["train"]["tau_best"]["step"] == best["step"]
    # the other family: same data and steps, its own τ-selected head, measured the same way beside EAGLE-3
    assert set(out["families"]) == {"eagle3", "medusa"} and out["families"]["eagle3"]["tau"] == out["tau"]
    med = out["families"]["medusa"]
    medusa_bench = json.loads((run / "benchmark-medusa.json").read_text())
    assert med["tau"] == medusa_bench["summary"]["tau"] and med["greedy_identical"] == med["turns"] == 2
    assert_tau_accounts_for_tokens(med["tau"], medusa_bench["rows"], deepest_draft(medusa_bench["drafter"]))
    assert medusa_bench["drafter"]["drafter"] == "medusa" and (run / "medusa" / "best" / "best.json").is_file()
    assert med["tau_best"]["step"] in (2, 4) and set(med["per_category"]) == {"a", "b"}
    hub = run / "hub"
    assert {"model.safetensors", "config.json", "README.md", "tau_table.json"} <= {f.name for f in hub.iterdir()}
    card = (hub / "README.md").read_text()
    assert "bash scripts/recipe_eagle3.sh" in card and "bf16" in card and "## How it was made" in card

    again = run_tree(cmd, timeout=900, env=env, cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "distillation finished earlier" in again.stdout  # a finished time-bounded distillation is not extended
    assert "eagle3 measured earlier" in again.stdout and "medusa measured earlier" in again.stdout
    assert "tokens/s measured earlier" in again.stdout  # measurements newer than their heads are not repeated
    rerun = json.loads((run / "recipe.json").read_text())["families"]
    assert {f: v["tau"] for f, v in rerun.items()} == {f: v["tau"] for f, v in out["families"].items()}
    # a family finished earlier keeps the time its trainer took, not the rerun's few seconds of checking
    assert {f: v["trained_s"] for f, v in rerun.items()} == {f: v["trained_s"] for f, v in out["families"].items()}
    assert all(v["trained_s"] > 0 and v["resumed_from_step"] == 0 for v in rerun.values())
    assert len((run / "distilled.jsonl").read_text().splitlines()) == len(records)  # nothing distilled twice


def test_recipe_refuses_shards_over_a_one_process_file(tmp_path):
    """DISTILL_PROCS=2 over a DATA file that one process wrote would not extend it (the shards cannot see it):
    refused before anything runs, naming the file and the way out."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "messages": []}\n')
    env = dict(os.environ, RUN=str(tmp_path / "run"), DATA=str(data), DISTILL_PROCS="2")
    p = subprocess.run(["bash", str(REPO / "scripts" / "recipe_eagle3.sh")], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"out={data} holds records that one process distilled" in p.stderr and "DISTILL_PROCS=1" in p.stderr
    assert not (tmp_path / "run").exists()  # refused before any stage ran
    bad = subprocess.run(["bash", str(REPO / "scripts" / "recipe_eagle3.sh")], capture_output=True, text=True,
                         env=dict(env, DISTILL_PROCS="two"), cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "DISTILL_PROCS must be a whole number >= 1, got 'two'" in bad.stderr


def test_recipe_refuses_an_unknown_family(tmp_path):
    """A typo in FAMILIES stops the recipe before any stage runs, naming the value and the allowed families."""
    env = dict(os.environ, RUN=str(tmp_path / "run"), FAMILIES="eagle3 medussa")
    p = subprocess.run(["bash", str(REPO / "scripts" / "recipe_eagle3.sh")], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "FAMILIES: 'medussa'" in p.stderr
    from draftheads.heads import registry

    assert set(p.stderr.split("allowed:")[1].split()) == set(registry.FAMILIES)  # every family has a recipe stage
    assert not (tmp_path / "run").exists()
