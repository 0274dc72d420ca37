"""Checkpoints chosen by measured τ (train.tau_eval): τ from eval's real greedy loop every K steps and at the end,
best/ = the head of the step with the highest τ (ties keep the earlier), exact resume of that bookkeeping, and the
evaluator reached through config only (train/ never imports eval/ or pipeline/)."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CHATML, REPO, compose, make_tokenizer, run_tree, synthetic_conversations, tiny_model, tiny_train_overrides

K = 3  # train.tau_eval.every in these tests
TAU = {"train.tau_eval.every": K, "train.tau_eval.evaluator.prompts": 6,
       "train.tau_eval.evaluator.max_new_tokens": 16, "optim.lr": 1e-3}
FAMILY_KW = {"medusa": {}, "eagle": {},
             "eagle3": {"head.aux_layers": "[1,2,3]", "head.draft_vocab_size": 100, "head.ttt_steps": 3}}


@pytest.fixture(scope="module")
def word_target_dir(tmp_path_factory) -> Path:
    """The tiny Llama whose lm_head only scores whole-word tokens (" cat", " fast", ...), ×20 (peaked).

    Its greedy text then decodes and re-encodes to the same tokens, so heads trained on its self-distilled
    answers learn its real greedy path and the measured τ moves during training (a random target's byte-level
    output does not survive the round trip, which pins τ near 1 whatever the heads learn)."""
    d = tmp_path_factory.mktemp("tiny-llama-words")
    tok = make_tokenizer(CHATML)
    words = [i for i in range(len(tok)) if re.fullmatch(r" [a-z]+", tok.decode([i]))]
    assert len(words) >= 20
    m = tiny_model("llama")
    keep = torch.zeros(m.lm_head.weight.shape[0], 1)
    keep[words] = 20.0
    with torch.no_grad():
        m.lm_head.weight.mul_(keep)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def distilled_file(tmp_path_factory, word_target_dir) -> Path:
    """The target's own greedy answers to 120 synthetic prompts (data_prep/distill.py, the real job)."""
    from draftheads.data_prep.distill import main as distill_main

    d = tmp_path_factory.mktemp("distilled")
    chats = d / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in synthetic_conversations(120)))
    out = d / "distilled.jsonl"
    distill_main(compose("distill", [
        "target=hf", f"target.name={word_target_dir}", "target.dtype=fp32", "target.local_files_only=true",
        "data=file", f"data.path={chats}", "data.heldout_fraction=0.0", "num_conversations=null", "batch_size=32",
        "max_new_tokens=16", "device=cpu", f"out={out}"]))
    return out


def _main(family: str):
    from importlib import import_module

    return import_module(f"draftheads.train.{family}").main


def _run(family: str, target_dir: Path, data: Path, out: Path, **kw):
    cfg = compose(family, tiny_train_overrides(target_dir, data, out, **{**TAU, **FAMILY_KW[family], **kw}))
    return _main(family)(cfg)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _taus(out: Path) -> dict[int, float]:
    return {r["step"]: r["tau_eval/tau"] for r in _rows(out) if "tau_eval/tau" in r}


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.parametrize("family", ["medusa", pytest.param("eagle", marks=pytest.mark.slow),
                                    pytest.param("eagle3", marks=pytest.mark.slow)])
def test_best_holds_the_head_of_the_step_with_the_highest_measured_tau(tmp_path, word_target_dir, distilled_file,
                                                                       family):
    out = tmp_path / family
    summary = _run(family, word_target_dir, distilled_file, out,
                   **{"train.max_steps": 4 * K + 2, "train.save_every": K, "train.keep_last": 10})
    taus = _taus(out)
    assert sorted(taus) == [K, 2 * K, 3 * K, 4 * K, 4 * K + 2]  # every K steps, and the final head
    assert len(set(taus.values())) > 1, taus  # τ moved, so choosing among the steps means something
    assert all(1.0 <= t <= 1 + 16 for t in taus.values())
    best_tau = max(taus.values())
    best_step = min(s for s, t in taus.items() if t == best_tau)  # a tie keeps the earlier step
    info = json.loads((out / "best" / "best.json").read_text())
    assert (info["step"], info["tau"]) == (best_step, best_tau)
    assert summary["tau_best"] == {"step": best_step, "tau": best_tau}
    # the bookkeeping each row logs is the running best up to that step
    for r in _rows(out):
        if "tau_eval/tau" in r:
            upto = {s: t for s, t in taus.items() if s <= r["step"]}
            m = max(upto.values())
            assert (r["tau_eval/best_tau"], r["tau_eval/best_step"]) == (m, min(s for s, t in upto.items() if t == m))
    # best/ holds exactly the weights of that step: the checkpoint of that step, or final/
    ref = out / "final" if best_step == 4 * K + 2 else out / "checkpoints" / f"step-{best_step:06d}"
    _same_weights(out / "best", ref)
    assert json.loads((out / "best" / "config.json").read_text())["step"] == best_step
    # and re-measuring best/ with a fresh evaluator on the same prompts gives the recorded τ
    from draftheads.heads.target import load_target
    from draftheads.pipeline.tau_eval import TauEvaluator

    target = load_target({"name": str(word_target_dir), "dtype": "fp32", "local_files_only": True})
    heldout_q = next((out / "data-cache").rglob("heldout_questions.jsonl"))
    again = TauEvaluator(target, heldout_q, prompts=6, max_new_tokens=16)(best_step, out / "best")
    assert again["tau"] == best_tau
    assert (out / "training.png").stat().st_size > 0


@pytest.mark.slow
def test_a_fine_tune_measures_its_starting_head_and_keeps_it_when_no_step_beats_it(tmp_path, word_target_dir,
                                                                                 distilled_file):
    """head.init_from: τ of the starting head is measured before step 1 (train.tau_eval.at_start=null means "when
    the head starts from trained weights"), and it is a best/ candidate. With lr 1e-30 (0 is refused) no fp32 weight
    moves, every step measures the same τ, so the tie keeps step 0 and best/ holds the starting head's weights."""
    start = tmp_path / "start"
    _run("eagle3", word_target_dir, distilled_file, start, **{"train.max_steps": 3 * K})
    kw = {"head.init_from": start / "final", "train.max_steps": K, "optim.lr": 1e-30}
    ft = tmp_path / "ft"
    summary = _run("eagle3", word_target_dir, distilled_file, ft, **kw)
    taus = _taus(ft)
    assert sorted(taus) == [0, K] and taus[0] == taus[K] > 1.0, taus
    assert taus[0] == _taus(start)[3 * K]  # the same head on the same prompts
    row0 = _rows(ft)[0]
    assert row0["step"] == 0 and "loss" not in row0 and "sim_tau/chain" in row0
    assert summary["tau_best"] == {"step": 0, "tau": taus[0]}
    assert json.loads((ft / "best" / "best.json").read_text())["step"] == 0
    _same_weights(ft / "best", start / "final")
    assert (ft / "training.png").stat().st_size > 0
    # at_start=false: no measurement before step 1, and the first measured step is best/
    off = tmp_path / "off"
    _run("eagle3", word_target_dir, distilled_file, off, **kw, **{"train.tau_eval.at_start": "false"})
    assert sorted(_taus(off)) == [K] and json.loads((off / "best" / "best.json").read_text())["step"] == K


def test_measuring_tau_does_not_change_training_and_every_0_writes_no_best(tmp_path, word_target_dir,
                                                                           distilled_file):
    kw = {"train.max_steps": 2 * K, "head.num_heads": 3}
    _run("medusa", word_target_dir, distilled_file, tmp_path / "on", **kw)
    _run("medusa", word_target_dir, distilled_file, tmp_path / "off", **{**kw, "train.tau_eval.every": 0,
                                                                        "train.eval_every": K})
    on, off = _rows(tmp_path / "on"), _rows(tmp_path / "off")
    assert sorted(_taus(tmp_path / "on")) == [K, 2 * K] and _taus(tmp_path / "off") == {}
    assert not (tmp_path / "off" / "best").exists() and (tmp_path / "on" / "best" / "best.json").is_file()
    assert not any(k.startswith("tau_eval/") for r in off for k in r)
    # a τ step also refreshes the held-out metrics, with the simulated τ over conf/head/medusa.yaml's sim_tree
    for r in on:
        if "tau_eval/tau" in r:
            assert 1.0 <= r["sim_tau/chain"] <= r["sim_tau/tree"] and "heldout_top1/1" in r, r
    # the evaluator's own random draws (building the drafter) never reach training's RNG streams
    loss = lambda rows: {r["step"]: r["loss"] for r in rows if "loss" in r}  # noqa: E731
    assert loss(on) == loss(off)
    _same_weights(tmp_path / "on" / "final", tmp_path / "off" / "final")


def test_resume_continues_the_best_bookkeeping_exactly(tmp_path, word_target_dir, distilled_file):
    kw = {"train.max_steps": 4 * K, "train.save_every": K, "train.keep_last": 10, "head.num_heads": 3}
    full = tmp_path / "full"
    _run("medusa", word_target_dir, distilled_file, full, **kw)
    state = json.loads((full / "checkpoints" / f"step-{2 * K:06d}" / "trainer_state" / "state.json").read_text())
    taus = _taus(full)
    upto = {s: t for s, t in taus.items() if s <= 2 * K}
    assert state["tau_best"]["tau"] == max(upto.values())

    # a job killed after step 3K+1: step-2K is the last complete checkpoint, and best/ was rewritten after it
    # (here: a head from later in the run with a τ no step reached) - the resume must put back step-2K's best/
    killed = tmp_path / "killed"
    shutil.copytree(full, killed)
    for s in (3 * K, 4 * K):
        shutil.rmtree(killed / "checkpoints" / f"step-{s:06d}")
    shutil.rmtree(killed / "final")
    shutil.rmtree(killed / "best")
    shutil.copytree(full / "checkpoints" / f"step-{3 * K:06d}", killed / "best", ignore=shutil.ignore_patterns("trainer*"))
    (killed / "best" / "best.json").write_text(json.dumps({"step": 3 * K, "tau": 99.0}))
    _run("medusa", word_target_dir, distilled_file, killed, **kw, **{"train.resume": "true"})

    assert _taus(killed) == taus
    bk = lambda rows: [(r["step"], r["tau_eval/best_step"], r["tau_eval/best_tau"])  # noqa: E731
                       for r in rows if "tau_eval/tau" in r]
    assert bk(_rows(killed)) == bk(_rows(full))
    untimed = lambda d: {k: v for k, v in json.loads((d / "best" / "best.json").read_text())["metrics"].items()  # noqa: E731
                         if k not in ("seconds", "tokens_per_s")}
    assert untimed(killed) == untimed(full)
    for k in ("step", "tau"):
        assert json.loads((killed / "best" / "best.json").read_text())[k] == json.loads((full / "best" / "best.json").read_text())[k]
    _same_weights(killed / "best", full / "best")
    _same_weights(killed / "final", full / "final")


def test_resuming_a_finished_run_changes_nothing(tmp_path, word_target_dir, distilled_file, caplog):
    """A rerun of a finished run (a recipe rerun resumes every stage) trains, measures and writes nothing: its
    metrics rows, best/, final/ and the summary of the process that trained it stay as they were."""
    kw = {"train.max_steps": 2 * K, "train.save_every": K, "head.num_heads": 2}
    out = tmp_path / "run"
    first = _run("medusa", word_target_dir, distilled_file, out, **kw)
    assert first["seconds"] > 0 and len(first["losses"]) > 0
    files = [out / "metrics.jsonl", out / "summary.json", out / "best" / "model.safetensors",
             out / "final" / "model.safetensors", out / "checkpoints" / f"step-{2 * K:06d}" / "model.safetensors"]
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    with caplog.at_level("INFO"):
        again = _run("medusa", word_target_dir, distilled_file, out, **kw, **{"train.resume": "true"})
    assert "finished earlier at step 6" in caplog.text
    assert again == first  # the trained run's summary, returned as it was written
    assert {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files} == before

    # killed after its last checkpoint but before its summary: the rerun finishes it (summary, final/) as usual
    (out / "summary.json").unlink()
    done = _run("medusa", word_target_dir, distilled_file, out, **kw, **{"train.resume": "true"})
    assert done["steps"] == 2 * K and done["resumed_from_step"] == 2 * K and (out / "summary.json").is_file()


def test_bad_tau_eval_settings_fail_naming_the_key(tmp_path, word_target_dir, distilled_file):
    for key, value, words in [("train.tau_eval.every", -1, "train.tau_eval.every"),
                              ("train.tau_eval.evaluator.prompts", 0, "train.tau_eval.evaluator.prompts"),
                              ("train.tau_eval.evaluator.tree", "{depth: 3, width: 2}",
                               "train.tau_eval.evaluator.tree.width")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            _run("medusa", word_target_dir, distilled_file, tmp_path / "bad", **{key: value, "train.max_steps": 1})
    # a wrong type is refused by the typed schema while composing, before anything loads
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        _run("medusa", word_target_dir, distilled_file, tmp_path / "bad", **{"train.tau_eval.every": "often"})
    assert "train.tau_eval.every" in str(e.value.__cause__)


def test_train_imports_neither_eval_nor_pipeline():
    """Issue 25: training does not depend on evaluation. The τ evaluator, the eval after training and Medusa's
    simulated-τ tree reach train/ as ``_target_`` strings in conf/, instantiated at run time."""
    for path in sorted((REPO / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            bad = [n for n in names if n.removeprefix("draftheads.").split(".")[0] in ("eval", "pipeline")]
            assert not bad, f"{path.relative_to(REPO)}:{node.lineno} imports {bad}"
    cfg = compose("medusa", [])
    assert cfg.train.tau_eval.evaluator._target_ == "draftheads.pipeline.tau_eval.TauEvaluator"
    assert cfg.train.eval_after._target_ == "draftheads.pipeline.eval_after.EvalAfter"
    assert cfg.head.sim_tree._target_ == "draftheads.eval.trees.default_tree"


@pytest.mark.slow
def test_two_process_run_measures_tau_on_rank_0_while_the_other_waits(tmp_path, word_target_dir, distilled_file):
    """DDP over gloo, 2 processes × batch 4 (the same global batch as 1 × 8): rank 0 alone decodes, rank 1 waits at
    the barrier, both carry on; τ, best/ and the logged bookkeeping match the single-process run."""
    import os
    import socket
    import sys

    kw = {**TAU, "train.max_steps": 2 * K, "head.num_heads": 3}
    single = tmp_path / "single"
    _run("medusa", word_target_dir, distilled_file, single, **kw)
    ddp = tmp_path / "ddp"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf/launch/ddp.yaml"),
           "--num_processes", "2", "--main_process_port", str(port), str(REPO / "train" / "medusa.py"),
           *tiny_train_overrides(word_target_dir, distilled_file, ddp, **{**kw, "train.batch_size": 4}),
           f"hydra.run.dir={ddp}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    p = run_tree(cmd, timeout=600, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    assert json.loads((ddp / "summary.json").read_text())["launch"]["num_processes"] == 2
    assert sorted(_taus(ddp)) == [K, 2 * K]
    assert _taus(ddp) == pytest.approx(_taus(single), abs=0.05)
    info = json.loads((ddp / "best" / "best.json").read_text())
    assert info["tau"] == max(_taus(ddp).values())
    assert not (ddp / ".tau-candidate").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_eagle3_best_is_what_the_eval_job_measures(tmp_path):
    """The embedded SmolLM2-135M: a few EAGLE-3 steps with τ measured every 2 steps; the eval job
    (eval/acceptance.py) on best/ with the same held-out prompts and settings reports the τ best.json records."""
    from draftheads.eval.acceptance import main as eval_main
    from draftheads.train.eagle3 import main as train_main

    out = tmp_path / "run"
    summary = train_main(compose("eagle3", [
        "data=sharegpt_small", "data.max_conversations=60", "data.max_length=128", "data.heldout_fraction=0.1",
        f"data.cache_dir={tmp_path / 'data'}", f"out_dir={out}", "logging.wandb=disabled", "train.device=cpu",
        "train.batch_size=2", "train.max_steps=4", "train.log_every=1", "train.save_every=0", "train.eval_tokens=300",
        "train.sim_tau_examples=2", "head.draft_vocab_size=4000", "head.ttt_steps=2", "optim.lr=1e-3",
        "optim.warmup_steps=0", "train.tau_eval.every=2", "train.tau_eval.evaluator.prompts=2",
        "train.tau_eval.evaluator.max_new_tokens=24"]))
    taus = _taus(out)
    assert sorted(taus) == [2, 4]
    for r in (r for r in _rows(out) if "tau_eval/tau" in r):  # each τ accounts for its acceptance and its tokens
        depth = sum(k.startswith("tau_eval/accept@") for k in r)
        assert depth >= 1 and r["tau_eval/tau"] == pytest.approx(
            1 + sum(r[f"tau_eval/accept@{d}"] for d in range(1, depth + 1)), abs=2e-3), r  # E[acc] = sum P(acc >= d)
        emitted = r["tau_eval/turns"] + r["tau_eval/tau"] * r["tau_eval/steps"]  # first tokens + accepted + 1 per step
        assert emitted - r["tau_eval/turns"] * depth - 0.01 <= r["tau_eval/new_tokens"] <= emitted + 0.01, r
    info = json.loads((out / "best" / "best.json").read_text())
    assert summary["tau_best"] == {"step": info["step"], "tau": info["tau"]} and info["tau"] == max(taus.values())
    heldout_q = next((tmp_path / "data").rglob("heldout_questions.jsonl"))
    res = eval_main(compose("eval", [
        f"checkpoint={out / 'best'}", f"questions={heldout_q}", "max_questions=2", "max_turns=1",
        "max_new_tokens=24", "data=sharegpt_small", f"out={tmp_path / 'eval.json'}",
        "tree.select=default"]))  # the fixed tree training measures with (tree=auto would size its own)
    assert res["drafter"]["drafter"] == "eagle3" and res["summary"]["tau"] == info["tau"]


def test_plot_run_redraws_a_stopped_runs_png(tmp_path):
    """A run stopped before its end has no training.png: scripts/plot_run.py draws it from metrics.jsonl."""
    from draftheads.scripts.plot_run import plot_run

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    rows = [{"step": s, "loss": 10.0 / s, "top1/s0": 0.1 * s / 10} for s in range(1, 11)]
    rows[4]["tau_eval/tau"], rows[9]["tau_eval/tau"] = 1.5, 1.7
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "best" / "best.json").write_text(json.dumps({"step": 10, "tau": 1.7}))
    png = plot_run(run, tmp_path / "copy.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (run / "training.png").stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path / "nothing")
