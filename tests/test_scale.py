"""Scale-out and operations: launch configs, multi-process equivalence (DDP and the real DeepSpeed ZeRO-2
engine on CPU) for every trainer, ZeRO-3/FSDP with a sharded target, SIGKILL + exact resume, the
simulated τ, sweeps with the report job, publishing.

Multi-process runs are real launches (``accelerate launch --config_file conf/launch/<x>.yaml``) of the
Hydra entries on a tiny random target, compared with an in-process single-process run of the same
global batch. Each launch costs ~15-25 s on 2 CPU cores; the first DeepSpeed launch on a fresh machine
also compiles DeepSpeed's small shared-memory op (~1 min, cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import (CONF, REPO, assert_tau_accounts_for_tokens, compose, deepest_draft, run_tree, tiny_model,
                      tiny_train_overrides)
from draftheads.train.loop import accepted_lengths, list_checkpoints, lockstep_batches

LAUNCH = CONF / "launch"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def _launch(config: str, nproc: int, entry: str, overrides: list[str], timeout: int = 420) -> None:
    cmd = ["accelerate", "launch", "--config_file", str(LAUNCH / f"{config}.yaml"), "--num_processes", str(nproc),
           "--main_process_port", str(_free_port()), str(REPO / "train" / f"{entry}.py"), *overrides]
    p = run_tree(cmd, timeout=timeout, cwd=REPO, env=_env())
    assert p.returncode == 0, f"{config} launch failed:\n{p.stderr[-4000:]}"


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _info(out: Path) -> dict:
    return json.loads((out / "run_info.json").read_text())


def _assert_same_weights(a: Path, b: Path, atol: float = 2e-5) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        torch.testing.assert_close(x[k], y[k], rtol=1e-4, atol=atol, msg=k)


def _main(family: str):
    if family == "medusa":
        from draftheads.train.medusa import main
    elif family == "eagle":
        from draftheads.train.eagle import main
    elif family == "block":
        from draftheads.train.block import main
    else:
        from draftheads.train.eagle3 import main
    return main


# Family knobs for the equivalence runs: EAGLE's feature noise draws per-rank random numbers, so it is
# off here (its RNG streams are per process by design; everything else must match exactly).
FAMILY_KW = {"medusa": {"head.num_heads": 3},
             "eagle": {"head.noise": "none"},
             "eagle3": {"head.aux_layers": "[1,2,3]", "head.draft_vocab_size": 100, "head.ttt_steps": 3},
             "block": {"head.context_layers": "[1,2,3]", "head.block_size": 4, "head.anchors": 4}}


# ------------------------------------------------------------------------------------------ configs

def test_launch_configs_are_complete():
    files = {p.stem: yaml.safe_load(p.read_text()) for p in LAUNCH.glob("*.yaml")}
    assert set(files) >= {"single", "ddp", "zero2", "zero3", "fsdp", "multinode"}
    for name, c in files.items():
        for key in ("distributed_type", "num_machines", "num_processes", "machine_rank", "use_cpu"):
            assert key in c, (name, key)
        assert c["use_cpu"] is False, name  # accelerate's CPU launcher would start a single process
    assert files["single"]["distributed_type"] == "NO" and files["single"]["num_processes"] == 1
    assert files["ddp"]["distributed_type"] == "MULTI_GPU"
    assert files["fsdp"]["distributed_type"] == "FSDP" and files["fsdp"]["fsdp_config"]["fsdp_version"] == 2
    assert files["multinode"]["num_machines"] >= 2
    for name, stage in (("zero2", 2), ("zero3", 3)):
        assert files[name]["distributed_type"] == "DEEPSPEED"
        ds_file = REPO / files[name]["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == stage
        assert "optimizer" not in ds and "scheduler" not in ds  # those come from conf/optim
        assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
        assert ds["train_micro_batch_size_per_gpu"] == "auto"  # filled from train.batch_size


def test_slurm_script_starts_one_launcher_per_node():
    env = dict(_env(), DRY_RUN="1", SLURM_NNODES="3", GPUS_PER_NODE="4", MASTER_ADDR="node001")
    p = subprocess.run(["bash", str(REPO / "scripts" / "slurm_train.sbatch"), "train/eagle.py", "run_name=a b"],
                       cwd=REPO, env=env, capture_output=True, text=True, check=True)
    nodes = [blk.strip().splitlines() for blk in p.stdout.split("--- node ")[1:]]
    assert len(nodes) == 3
    for rank, lines in enumerate(nodes):
        args = lines[1:]
        assert args[:4] == ["accelerate", "launch", "--config_file", "conf/launch/multinode.yaml"]
        assert args[args.index("--machine_rank") + 1] == str(rank)
        assert args[args.index("--num_processes") + 1] == "12" and args[args.index("--num_machines") + 1] == "3"
        assert args[args.index("--main_process_ip") + 1] == "node001"
        assert args[-2:] == ["train/eagle.py", "run_name=a b"]  # overrides pass through unsplit


def test_write_summary_ends_a_multi_process_run_and_only_that(tmp_path):
    """Every entry's last call: with several ranks it must barrier then destroy the process group (a gloo rank left
    to atexit aborted a finished ZeRO-2 launch); a single process keeps its state (tests call main() repeatedly)."""
    from types import SimpleNamespace

    from draftheads.train.loop import TrainResult, write_summary

    for n, main, expected in ((2, True, ["wait", "end"]), (2, False, ["wait", "end"]), (1, True, [])):
        calls: list[str] = []
        acc = SimpleNamespace(num_processes=n, is_main_process=main, wait_for_everyone=lambda: calls.append("wait"),
                              end_training=lambda: calls.append("end"))
        out = tmp_path / f"{n}-{main}"
        out.mkdir()
        result = TrainResult(out, out / "final", 4, [{"step": 4, "loss": 1.5}], 2.0, 10.0, 100.0)
        summary = write_summary(acc, out, "medusa", result, extra_field=7)
        assert calls == expected
        assert summary["losses"] == [1.5] and summary["extra_field"] == 7 and summary["family"] == "medusa"
        assert (out / "summary.json").exists() == main


# ------------------------------------------------------------------------------------------ equivalence

@pytest.mark.slow
@pytest.mark.parametrize("family", ["medusa", "eagle", "eagle3", "block"])
def test_ddp_and_deepspeed_zero2_match_single_process(tmp_path, tiny_target_dir, chat_file, family):
    """Same global batch (8), same losses after every step and same final weights: 1 process × batch 8 vs
    2 processes × batch 2 × accumulation 2, over gloo DDP and over the DeepSpeed ZeRO-2 engine."""
    kw = {"train.max_steps": 4, "train.save_every": 2, "train.keep_last": 5, "optim.lr": 3e-3, **FAMILY_KW[family]}
    single = tmp_path / "single"
    _main(family)(compose(family, tiny_train_overrides(tiny_target_dir, chat_file, single, **kw)))
    ref = _losses(single)
    assert sorted(ref) == [1, 2, 3, 4]
    multi = {**kw, "train.batch_size": 2, "train.grad_accum": 2}
    for config in ("ddp", "zero2"):
        out = tmp_path / config
        _launch(config, 2, family, tiny_train_overrides(tiny_target_dir, chat_file, out, **multi)
                + [f"hydra.run.dir={out}"])
        got = _losses(out)
        for s in ref:
            assert got[s] == pytest.approx(ref[s], rel=1e-5), (config, s, got, ref)
        _assert_same_weights(single / "final", out / "final")
        launch = _info(out)["launch"]
        assert launch["num_processes"] == 2 and launch["device"] == "cpu" and launch["backend"] == "gloo"
        if config == "ddp":
            assert launch["mode"] == "ddp" and launch["distributed_type"] == "MULTI_CPU"
            assert launch["engine"] == "DistributedDataParallel"
        else:  # the real engine, not accelerate's CPU fallback to DDP
            assert launch["mode"] == "deepspeed" and launch["distributed_type"] == "DEEPSPEED"
            assert launch["zero_stage"] == 2 and launch["engine"] == "DeepSpeedEngine"
            shards = sorted(p.name for p in (out / "checkpoints" / "step-000004" / "trainer_state" / "deepspeed"
                                             / "engine").iterdir())
            assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in shards
            assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards
        assert len(_info(out)["peak_rss_mb_per_rank"]) == 2
        # Hydra's .hydra/ copy is written once per run dir and still parses with two ranks writing
        assert yaml.safe_load((out / ".hydra" / "config.yaml").read_text())["train"]["batch_size"] == 2
    if family == "medusa":  # exact resume under DeepSpeed: the engine's sharded optimizer + our RNG/scheduler
        res = tmp_path / "zero2-resumed"
        shutil.copytree(tmp_path / "zero2", res)
        shutil.rmtree(res / "checkpoints" / "step-000004")
        shutil.rmtree(res / "final")
        (res / "medusa.log").unlink(missing_ok=True)
        _launch("zero2", 2, family, tiny_train_overrides(tiny_target_dir, chat_file, res, **multi)
                + [f"hydra.run.dir={res}", "train.resume=true"])
        got = _losses(res)
        assert sorted(got) == [1, 2, 3, 4]
        for s in (3, 4):
            assert got[s] == pytest.approx(ref[s], rel=1e-5), (s, got, ref)
        _assert_same_weights(single / "final", res / "final")
        log_lines = (res / "medusa.log").read_text().splitlines()
        assert sum("resumed from" in ln for ln in log_lines) == 1  # only rank 0 writes the job log


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3", "fsdp"])
def test_zero3_and_fsdp_shard_draft_and_target_and_save_loadable_heads(tmp_path, tiny_target_dir, chat_file,
                                                                        config):
    from draftheads.heads.medusa import MedusaHeads
    from draftheads.heads.target import load_target

    kw = {"train.max_steps": 4, "train.save_every": 2, "train.keep_last": 5, "optim.lr": 3e-3, "head.num_heads": 3}
    single = tmp_path / "single"
    _main("medusa")(compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, single, **kw)))
    out = tmp_path / config
    multi = {**kw, "train.batch_size": 4}
    _launch(config, 2, "medusa", tiny_train_overrides(tiny_target_dir, chat_file, out, **multi)
            + [f"hydra.run.dir={out}"])
    launch = _info(out)["launch"]
    assert launch["mode"] == ("deepspeed" if config == "zero3" else "fsdp")
    if config == "zero3":
        assert launch["zero_stage"] == 3 and launch["engine"] == "DeepSpeedEngine"
        assert launch["target_sharding"]["kind"] == "zero3-decoder-layers"
    else:
        assert launch["engine"].startswith("FSDP") and launch["target_sharding"]["kind"] == "fsdp2-decoder-layers"
    assert 0.45 <= launch["target_sharding"]["local_fraction"] <= 0.6  # each rank holds ~half the layers
    ref, got = _losses(single), _losses(out)
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), (s, got, ref)
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    for ckpt in (out / "checkpoints" / "step-000002", out / "final"):  # gathered full weights on rank 0
        MedusaHeads.from_pretrained(ckpt, tgt)
    _assert_same_weights(single / "final", out / "final")
    if config == "fsdp":  # resume from the gathered optimizer state
        res = tmp_path / "fsdp-resumed"
        shutil.copytree(out, res)
        shutil.rmtree(res / "checkpoints" / "step-000004")
        shutil.rmtree(res / "final")
        _launch(config, 2, "medusa", tiny_train_overrides(tiny_target_dir, chat_file, res, **multi)
                + [f"hydra.run.dir={res}", "train.resume=true"])
        got = _losses(res)
        for s in (3, 4):
            assert got[s] == pytest.approx(ref[s], rel=1e-5), (s, got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3", "fsdp"])
def test_eagle_heldout_metrics_and_simulated_tau_run_in_lockstep_when_sharded(tmp_path, tiny_target_dir, chat_file,
                                                                              config):
    """EAGLE with a sharded target (and draft): held-out metrics and the simulated τ (the draft's cached chain
    rollout) run the same collective forwards on every rank, uneven shares included (a rank that stopped early
    would hang the others), and give the single-process numbers."""
    kw = {"train.max_steps": 4, "train.eval_every": 2, "train.eval_tokens": 400, "train.sim_tau_examples": 9,
          "optim.lr": 3e-3, **FAMILY_KW["eagle"]}
    single = tmp_path / "single"
    _main("eagle")(compose("eagle", tiny_train_overrides(tiny_target_dir, chat_file, single, **kw)))
    out = tmp_path / config
    _launch(config, 2, "eagle", tiny_train_overrides(tiny_target_dir, chat_file, out, **{**kw, "train.batch_size": 4})
            + [f"hydra.run.dir={out}"])
    info = _info(out)
    assert info["launch"]["target_sharding"]["kind"] == ("zero3" if config == "zero3" else "fsdp2") + "-decoder-layers"

    def evals(run: Path) -> dict[int, dict]:
        return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "heldout_feat" in r}

    ref, got = evals(single), evals(out)
    assert sorted(ref) == sorted(got) == [2, 4]
    for s in ref:
        for k in ("heldout_feat", "heldout_ce", "heldout_top1", "sim_tau/positions"):
            assert got[s][k] == pytest.approx(ref[s][k], rel=1e-4, abs=1e-6), (s, k, got[s], ref[s])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["launch"] == info["launch"] and len(summary["peak_rss_mb_per_rank"]) == 2


def test_deepspeed_checkpoints_are_read_without_unpickling_code(tmp_path):
    """Our engine patch makes DeepSpeed's checkpoint reader refuse pickled code (weights_only=True)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from draftheads.train.loop import _safe_deepspeed_checkpoint_engine

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

    eng = Engine()
    _safe_deepspeed_checkpoint_engine(eng)
    good = tmp_path / "good.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "step": torch.tensor(3)},
                "ds_version": "0.19.8"}, good)
    assert eng.checkpoint_engine.load(str(good))["optimizer_state_dict"]["step"].item() == 3
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    bad = tmp_path / "bad.pt"
    torch.save({"x": Evil()}, bad)
    with pytest.raises(Exception, match="[Ww]eights only"):
        eng.checkpoint_engine.load(str(bad))
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ kill + resume

@pytest.mark.slow
def test_sigkill_mid_training_then_resume_matches_uninterrupted(tmp_path, tiny_target_dir, chat_file):
    from draftheads.train.medusa import main

    kw = {"train.max_steps": 30, "train.save_every": 3, "train.keep_last": 2, "optim.lr": 3e-3}
    full = tmp_path / "full"
    main(compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, full, **kw)))
    ref = _losses(full)
    out = tmp_path / "killed"
    cmd = [sys.executable, str(REPO / "train" / "medusa.py"),
           *tiny_train_overrides(tiny_target_dir, chat_file, out, **kw), f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        ck = list_checkpoints(out)
        if ck and ck[-1][0] >= 9:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the job ended before it could be killed:\n" + proc.stderr.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final").exists()  # it really died mid-run
    last = list_checkpoints(out)[-1][0]
    assert 9 <= last < 30
    # what a kill during a save leaves behind must never be picked up
    half = out / "checkpoints" / ".step-000029.tmp" / "trainer_state"
    half.mkdir(parents=True)
    (half / "optimizer.pt").write_bytes(b"truncated")
    (out / "checkpoints" / "step-000028" / "trainer_state").mkdir(parents=True)  # no state.json: incomplete
    assert list_checkpoints(out)[-1][0] == last
    main(compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, out, **kw, **{"train.resume": "true"})))
    got = _losses(out)
    assert sorted(got) == list(range(1, 31))
    assert got[last + 1] == pytest.approx(ref[last + 1], rel=1e-5, abs=1e-7)  # the next-step loss
    for s in range(last + 1, 31):
        assert got[s] == pytest.approx(ref[s], rel=1e-5, abs=1e-7), (s, got[s], ref[s])
    _assert_same_weights(full / "final", out / "final")
    st = json.loads((out / "checkpoints" / "step-000030" / "trainer_state" / "state.json").read_text())
    assert st["data_position"] == 30 * 8 and st["step"] == 30
    assert len(list_checkpoints(out)) == 2  # keep_last


# ------------------------------------------------------------------------------------------ simulated τ

def test_accepted_lengths_chain_and_tree():
    ranks = torch.tensor([[0, 0, 3], [0, 1, 0], [2, 0, 0], [0, 0, 0], [10, 0, 0]])
    assert accepted_lengths(ranks).tolist() == [2, 1, 0, 3, 0]
    tree = [(0,), (1,), (0, 0), (0, 1), (0, 1, 0), (1, 0)]
    assert accepted_lengths(ranks, tree).tolist() == [2, 3, 0, 2, 0]
    assert accepted_lengths(torch.zeros(0, 3, dtype=torch.long)).tolist() == []


def test_lockstep_batches_give_every_rank_the_same_count():
    class A:
        def __init__(self, r, w):
            self.process_index, self.num_processes = r, w

    for n in (0, 1, 7, 8, 9):
        per_rank = [lockstep_batches(n, 2, A(r, 2)) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1])
        counted = sorted(i for pr in per_rank for idx, c in pr if c for i in idx)
        assert counted == list(range(n))  # every row exactly once


def test_simulated_tau_equals_real_greedy_decoding_at_every_step_start():
    """On a greedy continuation, the teacher-forced simulation accepts exactly what decoding accepts."""
    from draftheads.eval.drafters import MedusaDrafter
    from draftheads.eval.generate import NoDrafter, generate
    from draftheads.eval.trees import chain, default_tree
    from draftheads.heads.medusa import MedusaHeads, medusa_config_for
    from draftheads.heads.target import from_model
    from draftheads.train.medusa import MedusaObjective

    torch.manual_seed(0)
    tgt = from_model(tiny_model("llama", vocab_size=48, hidden=32, seed=3))
    K = 3
    heads = MedusaHeads(medusa_config_for(tgt, K, 1, False), tgt.lm_head())
    obj = MedusaObjective(heads, tgt)
    prompt = [5, 9, 17, 3, 22, 8]
    plain = generate(tgt, NoDrafter(), prompt, 40).tokens
    ids = torch.tensor([prompt + plain])
    T = ids.shape[1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.tensor([[0] * len(prompt) + [1] * len(plain)])}
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)  # fit the heads a little so that drafts get accepted
    for _ in range(25):
        loss, _ = obj(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    obj.eval()
    for tree in (chain(K), default_tree(K, 12)):
        res = generate(tgt, MedusaDrafter(heads, tree), prompt, 40)
        assert res.tokens == plain
        ranks, considered = obj.acceptance_ranks(batch)
        assert considered == len(plain)
        # the whole continuation is greedy, so every position t >= p-1 with K+1 tokens after it is scored
        first = len(prompt) - 1
        assert ranks.shape[0] == T - K - 1 - first
        sim = accepted_lengths(ranks, None if tree.size == K + 1 else tree.paths)
        t, checked = first, 0
        for a in res.accepted:  # step i starts at t_i; t_{i+1} = t_i + a_i + 1
            if t + K + 1 <= T - 1:
                assert int(sim[t - first]) == a, (t, a, int(sim[t - first]))
                checked += 1
            t += a + 1
        assert checked >= 5 and sum(res.accepted) > 0  # nontrivial: the heads do get tokens accepted


def test_simulated_tau_is_logged_with_each_evaluation(tmp_path, tiny_target_dir, chat_file):
    """Held-out rows that are the target's own greedy continuations (self-distilled): the loop logs sim τ
    at every evaluation, scoring (nearly) every position. Rows are token ids: a random tiny target's
    byte-level output does not survive a decode/encode round trip through text."""
    from datasets import Dataset

    from draftheads.data_prep.dataset import collate
    from draftheads.eval.generate import NoDrafter, generate
    from draftheads.eval.trees import default_tree
    from draftheads.heads.medusa import MedusaHeads, medusa_config_for
    from draftheads.heads.target import load_target
    from draftheads.train.loop import Trainer, make_accelerator
    from draftheads.train.medusa import MedusaObjective

    cfg = compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "run", **{
        "train.max_steps": 4, "train.eval_every": 2, "train.batch_size": 4, "head.num_heads": 2,
        "train.sim_tau_examples": 6}))
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        prompt = torch.randint(10, 300, (6,), generator=g).tolist()
        out = generate(tgt, NoDrafter(), prompt, 20).tokens
        rows.append({"input_ids": prompt + out, "loss_mask": [0] * 6 + [1] * len(out)})
    data = Dataset.from_list(rows)
    acc = make_accelerator(cfg)
    heads = MedusaHeads(medusa_config_for(tgt, 2, 1, False), tgt.lm_head())
    obj = MedusaObjective(heads, tgt, sim_tree=default_tree)  # what conf/head/medusa.yaml's sim_tree builds
    trainer = Trainer(cfg, acc, obj, data, lambda r: collate(r, 0), tmp_path / "run", heldout=data)
    trainer.fit()
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "sim_tau/chain" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["sim_tau/positions"] == 6 * (20 - 2) and r["sim_tau/coverage"] > 0.85
        assert 1.0 <= r["sim_tau/chain"] <= r["sim_tau/tree"] <= 3.0  # a tree accepts at least the chain
        assert r["sim_accept/chain@1"] >= r["sim_accept/chain@2"]


# ------------------------------------------------------------------------------------------ sweeps

@pytest.mark.slow
def test_sweep_trains_evaluates_and_reports(tmp_path, tiny_target_dir, chat_file):
    sweep = tmp_path / "sweep"
    ov = [o for o in tiny_train_overrides(tiny_target_dir, chat_file, tmp_path / "unused", **{
        "train.max_steps": 3, "train.eval_after.enabled": "true", "train.eval_after.max_questions": 2,
        "train.eval_after.max_new_tokens": 8}) if not o.startswith("out_dir=")]
    cmd = [sys.executable, str(REPO / "train" / "medusa.py"), "-m", "head.num_heads=1,2", "head.num_layers=0,1",
           *ov, f"hydra.sweep.dir={sweep}"]
    p = run_tree(cmd, timeout=600, cwd=REPO, env=_env())
    assert p.returncode == 0, p.stderr[-4000:]
    for j in range(4):
        assert (sweep / str(j) / "eval.json").is_file() and (sweep / str(j) / "summary.json").is_file()
    report = json.loads((sweep / "report.json").read_text())  # written by the sweep's own callback
    assert report["knobs"] == ["head.num_heads", "head.num_layers"]
    rows = {(r["head.num_heads"], r["head.num_layers"]): r for r in report["rows"]}
    assert set(rows) == {("1", "0"), ("1", "1"), ("2", "0"), ("2", "1")}
    H, V = 64, 400
    for (k, n), r in rows.items():
        k, n = int(k), int(n)
        assert r["status"] == "ok" and r["family"] == "medusa"
        assert r["params"] == k * (n * (H * H + H) + V * H)
        # a step accepts at most the deepest branch: the k heads' chain, or a prompt-lookup branch tree=auto
        # may merge in (its length is in eval.json's drafter; timed choice, so it differs between hosts)
        branch = json.loads((sweep / str(r["job"]) / "eval.json").read_text())["drafter"].get("lookup_branch", 0)
        assert 1.0 <= r["tau"] <= 1 + max(k, branch)
        assert r["train_seconds"] is not None and r["train_tokens_per_s"] > 0 and r["steps"] == 3
    md = (sweep / "report.md").read_text()
    assert len([ln for ln in md.splitlines() if ln.startswith("| ")]) == 5 and "τ (eval)" in md
    assert (sweep / "report.png").stat().st_size > 1000 and (sweep / "report.csv").read_text().count("\n") == 5
    # the report job also runs on its own
    from draftheads.scripts.sweep_report import main as report_main

    again = report_main([str(sweep)])
    assert [r["tau"] for r in again["rows"]] == [r["tau"] for r in report["rows"]]


# ------------------------------------------------------------------------------------------ publishing

@pytest.mark.slow  # 8-14 s: a whole job chain or a child process; the fast tier keeps the unit checks
def test_publish_folder_round_trips_and_pushes_only_when_asked(tmp_path, tiny_target_dir, chat_file, monkeypatch,
                                                               capsys):
    from draftheads.eval.acceptance import main as eval_main
    from draftheads.heads.medusa import MedusaHeads
    from draftheads.heads.target import load_target
    from draftheads.scripts import publish
    from draftheads.train.medusa import main

    run = tmp_path / "run"
    main(compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, run, **{"head.num_heads": 2})))
    ev = compose("eval", [f"checkpoint={run / 'final'}", "target=hf", f"target.name={tiny_target_dir}",
                          "target.dtype=fp32", "questions=null", "data=file", f"data.path={chat_file}", "data.max_length=64", "data.heldout_fraction=0.1",
                          f"data.cache_dir={run / 'data-cache'}", "max_questions=2", "max_new_tokens=8",
                          f"out={run / 'eval.json'}"])
    measured = eval_main(ev)
    secret = "hf_THIS_IS_A_SECRET_TOKEN_123"
    monkeypatch.setenv("HF_TOKEN", secret)
    pcfg = lambda *o: compose("publish", [f"checkpoint={run / 'final'}", "overwrite=true", *o])  # noqa: E731  (republished below)
    res = publish.main(pcfg())
    hub = Path(res["folder"])
    assert hub == run / "hub" and not res["pushed"]
    assert set(res["files"]) >= {"model.safetensors", "config.json", "README.md", "training_config.yaml",
                                 "tau_table.json", "training_summary.json"}
    assert res["checks"]["loaded"] is True  # read back by the family loader on its target
    card = (hub / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "draftheads" and "medusa" in meta["tags"]
    head_cfg = json.loads((hub / "config.json").read_text())
    assert head_cfg["target"]["fingerprint"] in card and "## Measured τ" in card
    tau = json.loads((hub / "tau_table.json").read_text())
    assert len(tau) == 1 and tau[0]["tau"] == measured["summary"]["tau"] and f"{tau[0]['tau']:.3f}" in card
    assert_tau_accounts_for_tokens(measured["summary"]["tau"], measured["rows"], deepest_draft(measured["drafter"]))
    assert yaml.safe_load((hub / "training_config.yaml").read_text())["head"]["num_heads"] == 2
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    a, b = MedusaHeads.from_pretrained(hub, tgt), MedusaHeads.from_pretrained(run / "final", tgt)
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(v, w)
    # a bf16 copy: half the bytes, loads back, equals the checkpoint cast; the card says how it was made
    res16 = publish.main(pcfg("dtype=bf16", f"out={run / 'hub16'}", "made_by='bash scripts/recipe_eagle3.sh'",
                              "commit=abc123def456"))
    hub16 = Path(res16["folder"])
    assert res16["checks"]["loaded"] is True
    assert (hub16 / "model.safetensors").stat().st_size < 0.6 * (hub / "model.safetensors").stat().st_size
    c16 = MedusaHeads.from_pretrained(hub16, tgt)
    for (k, v), (_, w) in zip(c16.state_dict().items(), b.state_dict().items()):
        assert torch.equal(v, w.to(torch.bfloat16).to(v.dtype)), k
    card16 = (hub16 / "README.md").read_text()
    assert "abc123def456" in card16 and "bash scripts/recipe_eagle3.sh" in card16 and "bf16" in card16
    with pytest.raises(ValueError, match="dtype='int4'"):
        publish.main(pcfg("dtype=int4", f"out={run / 'hub4'}"))
    # push=true alone is still a dry run: no network
    calls: list[tuple] = []

    class FakeApi:
        def create_repo(self, **kw):
            calls.append(("create_repo", kw))

        def create_branch(self, **kw):
            calls.append(("create_branch", kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))
            return type("Info", (), {"commit_url": "https://huggingface.co/me/heads/commit/abc"})()

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    publish.main(pcfg("push=true", "repo_id=me/heads"))
    assert calls == []
    with pytest.raises(ValueError, match="repo_id"):
        publish.main(pcfg("push=true", "dry_run=false"))
    with pytest.raises(ValueError, match="not a valid Hub repository id"):
        publish.main(pcfg("push=true", "dry_run=false", "repo_id=bad id/with spaces"))
    res = publish.main(pcfg("push=true", "dry_run=false", "repo_id=me/heads", "branch=v1"))
    assert res["pushed"] and [c[0] for c in calls] == ["create_repo", "create_branch", "upload_folder"]
    assert calls[0][1]["repo_id"] == "me/heads" and calls[0][1]["private"] is True
    assert calls[2][1]["folder_path"] == str(hub) and calls[2][1]["revision"] == "v1"
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    for f in hub.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes()


def test_publish_tau_table_reads_a_measure_run(tmp_path):
    """eval/measure.py results give the card one row per trained head: τ, × plain and τ per category."""
    from draftheads.scripts.publish import model_card
    from draftheads.scripts.tau_table import tau_rows

    block = {"mode": "greedy", "methods": {
        "plain": {"tau": 1.0, "tokens_per_s": 20.0, "turns": 2},
        "eagle3": {"tau": 1.6, "tokens_per_s": 25.0, "turns": 2, "per_category": {"math": {"tau": 1.7}, "coding": {"tau": 1.5}}}},
        "speedup_vs_plain": {"plain": {"overall": 1.0}, "eagle3": {"overall": 1.25}}}
    res = {"questions": "q/mt_bench.jsonl", "num_questions": 2, "dtype": "bf16", "max_new_tokens": 16,
           "methods": {"plain": {"kind": "plain", "checkpoint": None},
                       "eagle3": {"kind": "eagle3", "checkpoint": "x", "drafter": "eagle3", "tree_kind": "dynamic",
                                  "tree_select": "auto", "tree_size": 6}},
           "settings": {"greedy": block, "t0.7": {**block, "mode": "exact"}}}
    f = tmp_path / "results.json"
    f.write_text(json.dumps(res))
    rows = tau_rows([f])
    assert len(rows) == 1 and rows[0]["tau"] == 1.6 and rows[0]["speedup_vs_plain"] == 1.25
    assert rows[0]["per_category"] == {"math": 1.7, "coding": 1.5} and rows[0]["dtype"] == "bf16"
    card = model_card({"family": "eagle3", "target": {"name": "smollm2-135m"}}, None, None, rows, "apache-2.0", 10)
    assert "1.25× plain" in card and "| mt_bench.jsonl (bf16) | 1.500 | 1.700 |" in card
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        tau_rows([tmp_path / "bad.json"])


def test_publish_card_license_follows_the_target():
    """A draft trained on a target's states inherits the target's terms: license=auto writes Gemma's license and its
    notice for gemma3-270m, SmolLM2's apache-2.0, ``other`` (with a way out) for a target we cannot know; an explicit
    id wins but keeps the target's notice. The use line names an embedded target as the offline config it is."""
    import yaml as _yaml

    from draftheads.scripts.publish import model_card

    def card(name: str, lic: str = "auto") -> tuple[dict, str]:
        text = model_card({"family": "eagle3", "target": {"name": name}}, None, None, [], lic, 10)
        return _yaml.safe_load(text.split("---\n")[1]), text

    meta, text = card("gemma3-270m")
    assert meta["license"] == "gemma" and meta["base_model"] == "google/gemma-3-270m"
    assert "Gemma Terms of Use found at ai.google.dev/gemma/terms" in text
    assert "checkpoint=heads/ target=gemma3-270m" in text
    meta, text = card("smollm2-135m")
    assert meta["license"] == "apache-2.0" and "Terms of Use" not in text and "license=<id>" not in text
    meta, text = card("/data/my-model.gguf")
    assert meta["license"] == "other" and "license=<id>" in text and "base_model" not in meta
    meta, text = card("gemma3-270m", "apache-2.0")
    assert meta["license"] == "apache-2.0" and "Gemma Terms of Use" in text


def test_publish_keeps_only_the_published_heads_figures(tmp_path):
    """A measure run over several heads, or a result on the run's final/ when best/ is published, must not lend the
    card another head's τ: rows are kept by the weights they measured (same folder or the same bytes)."""
    from draftheads.scripts.tau_table import tau_rows

    heads = {}
    for name, fill in (("best", 1.0), ("final", 2.0), ("copy", 1.0)):
        heads[name] = tmp_path / name
        heads[name].mkdir()
        save_file({"w": torch.full((4,), fill)}, str(heads[name] / "model.safetensors"))
    block = {"mode": "greedy", "methods": {"plain": {"tau": 1.0, "tokens_per_s": 20.0, "turns": 2},
                                          "b": {"tau": 2.4, "tokens_per_s": 30.0, "turns": 2},
                                          "f": {"tau": 1.9, "tokens_per_s": 25.0, "turns": 2}},
             "speedup_vs_plain": {"b": {"overall": 1.5}, "f": {"overall": 1.2}}}
    res = {"questions": "mt_bench.jsonl", "num_questions": 2, "dtype": "bf16", "max_new_tokens": 16,
           "methods": {"plain": {"kind": "plain", "checkpoint": None},
                       "b": {"kind": "eagle3", "checkpoint": str(heads["copy"]), "drafter": "eagle3"},
                       "f": {"kind": "eagle3", "checkpoint": str(heads["final"]), "drafter": "eagle3"}},
           "settings": {"greedy": block}}
    measure = tmp_path / "results.json"
    measure.write_text(json.dumps(res))
    acc = tmp_path / "eval.json"  # an acceptance result on final/
    acc.write_text(json.dumps({"drafter": {"drafter": "eagle3", "head": str(heads["final"])}, "mode": "greedy",
                               "summary": {"tau": 1.9, "turns": 2}}))
    rows = tau_rows([measure], heads["best"])
    assert [(r["tau"], r["speedup_vs_plain"]) for r in rows] == [(2.4, 1.5)]  # the copy's bytes are best/'s
    assert [r["tau"] for r in tau_rows([measure, acc], heads["final"])] == [1.9, 1.9]
    with pytest.raises(ValueError, match="not the checkpoint being published"):
        tau_rows([acc], heads["best"])
    assert tau_rows([acc], heads["best"], optional=(acc,)) == []  # the run's own eval.json: skipped, not an error


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero3", "fsdp"])
def test_the_block_draft_trains_under_every_engine_and_saves_a_loadable_head(tmp_path, tiny_target_dir, chat_file,
                                                                             config):
    """The block family under the sharding engines (DDP and ZeRO-2 run in the equivalence test above): 2 processes,
    the real engine, every step logged with a finite loss, held-out metrics, and a head that loads."""
    import math

    from draftheads.heads.block import BlockDraft
    from draftheads.heads.target import load_target

    out = tmp_path / config
    kw = {"train.max_steps": 3, "train.save_every": 3, "train.eval_every": 3, "train.eval_tokens": 200,
          "optim.lr": 3e-3, "head.context_layers": "[1,2,3]", "head.block_size": 4, "head.anchors": 4,
          "train.batch_size": 2}
    _launch(config, 2, "block", tiny_train_overrides(tiny_target_dir, chat_file, out, **kw)
            + [f"hydra.run.dir={out}"])
    launch = _info(out)["launch"]
    assert launch["num_processes"] == 2
    assert launch["mode"] == {"ddp": "ddp", "fsdp": "fsdp"}.get(config, "deepspeed")
    if config.startswith("zero"):
        assert launch["zero_stage"] == int(config[-1]) and launch["engine"] == "DeepSpeedEngine"
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    assert any("heldout_ce" in r and math.isfinite(r["heldout_ce"]) for r in rows)
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    for ckpt in (out / "checkpoints" / "step-000003", out / "final"):  # full weights, gathered on rank 0
        draft = BlockDraft.from_pretrained(ckpt, tgt)
        assert draft.config.block_size == 4 and all(torch.isfinite(p).all() for p in draft.parameters())
