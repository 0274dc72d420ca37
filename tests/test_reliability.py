"""Issue 24: one message per user error, no silent wrong results, outputs that follow the umask.

The entry mechanics (heads/job.py) are tested in-process on a throwaway Hydra config; the shipped entries
end-to-end in subprocesses (marked slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from draftheads.heads import job


# --------------------------------------------------------------------------- heads/job.py in-process

@pytest.fixture(autouse=True)
def _test_process_keeps_glibc_malloc(monkeypatch):
    """Entries called in this process must not switch the test process's malloc (tests/test_malloc.py covers it)."""
    monkeypatch.setattr(job, "keep_freed_memory", lambda: False)


def _hydra_app(tmp_path: Path, body):
    """A decorated entry with its own config dir: `x: 1`, run dir under tmp_path."""
    conf = tmp_path / "conf"
    conf.mkdir(exist_ok=True)
    (conf / "app.yaml").write_text(f"x: 1\nneed: ???\nhydra:\n  run:\n    dir: {tmp_path}/hydra\n"
                                   "  job:\n    chdir: false\n")

    @job.main(config_name="app", config_path=str(conf))
    def entry(cfg):
        return body(cfg)

    return entry


def _run(entry, monkeypatch, *argv: str) -> int | None:
    monkeypatch.setattr(sys, "argv", ["app.py", *argv])
    try:
        entry()
    except SystemExit as e:
        return e.code
    return None


def test_user_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    def body(cfg):
        raise ValueError(f"x must be >= 2, got {cfg.x}")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("DRAFTHEADS_DEBUG", raising=False)
    assert _run(_hydra_app(tmp_path, body), monkeypatch, "need=1") == 2
    err = capsys.readouterr().err
    assert err == "error: x must be >= 2, got 1\n", err
    # the job log file keeps the entry file's name, as with a plain hydra.main
    assert (tmp_path / "hydra" / "test_reliability.log").is_file()


def test_missing_file_and_unset_value_are_user_errors(tmp_path, monkeypatch, capsys):
    def body(cfg):
        return cfg.need if cfg.x == 1 else open(tmp_path / "nope.json")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("DRAFTHEADS_DEBUG", raising=False)
    assert _run(_hydra_app(tmp_path, body), monkeypatch) == 2
    assert capsys.readouterr().err == "error: config key need has no value (it is ??? in the config): pass need=<value>\n"
    assert _run(_hydra_app(tmp_path, body), monkeypatch, "need=1", "x=2") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: [Errno 2] No such file or directory") and "nope.json" in err and "\n" == err[-1]
    assert err.count("\n") == 1


def test_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    def body(cfg):
        raise RuntimeError("internal bug")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert _run(_hydra_app(tmp_path, body), monkeypatch, "need=1") == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: internal bug" in err


@pytest.mark.parametrize("var", ["HYDRA_FULL_ERROR", "DRAFTHEADS_DEBUG"])
def test_debug_switch_shows_the_traceback(tmp_path, monkeypatch, capsys, var):
    def body(cfg):
        raise ValueError("bad value")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv(var, "1")
    entry = _hydra_app(tmp_path, body)
    if var == "HYDRA_FULL_ERROR":  # Hydra re-raises the exception itself
        with pytest.raises(ValueError, match="bad value"):
            _run(entry, monkeypatch, "need=1")
    else:
        assert _run(entry, monkeypatch, "need=1") == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and "ValueError: bad value" in err


def test_config_composition_error_exits_2_without_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    ran = []
    assert _run(_hydra_app(tmp_path, ran.append), monkeypatch, "need=1", "nosuchkey=3") == 2
    err = capsys.readouterr().err
    assert not ran and "nosuchkey" in err and "Traceback" not in err


def test_cli_exit_codes(capsys):
    def main(argv):
        if argv == ["bad"]:
            raise ValueError("argument 'bad' is not allowed")
        return 3 if argv == ["three"] else {"ok": 1}

    for argv, code in ((["bad"], 2), (["three"], 3), ([], 0)):
        with pytest.raises(SystemExit) as ei:
            job.cli(main, argv)
        assert ei.value.code == code
    assert capsys.readouterr().err == "error: argument 'bad' is not allowed\n"


# --------------------------------------------------------------------------- shipped entries, subprocesses

def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    for k in ("HYDRA_FULL_ERROR", "DRAFTHEADS_DEBUG"):
        env.pop(k, None)
    env.update(extra)
    return env


def run_entry(entry: str, *overrides: str, cwd: Path, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / entry), *overrides], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def error_line(p: subprocess.CompletedProcess) -> str:
    """The single 'error: ...' line of a user error (and no traceback anywhere)."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, p.stderr[-3000:]
    return lines[0]


# --------------------------------------------------------------------------- silent wrong results -> errors

@pytest.mark.parametrize("env, rank, suffix", [
    ({}, (0, 1), ""),  # not launched
    ({"RANK": "0", "WORLD_SIZE": "1"}, (0, 1), ""),  # a one-process launch names files as if not launched
    ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4), ".rank2"),
])
def test_launch_rank_and_rank_suffix_read_the_launcher(monkeypatch, env, rank, suffix):
    """One reader of RANK/WORLD_SIZE: per-process file names (``${rank_suffix:}``) and distill's shard=auto agree."""
    from draftheads.data_prep.shards import parse_shard

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert job.launch_rank() == rank and job.launch_rank(env) == rank
    assert job.rank_suffix() == suffix
    assert parse_shard("auto") == rank
    with pytest.raises(ValueError, match="shard must be auto or i/n"):
        parse_shard("auto", {"RANK": "x", "WORLD_SIZE": "2"})  # a malformed launcher value: the one-line message


def test_config_int_keeps_an_explicit_zero():
    assert job.config_int({"n": None}, "n", 60) == 60 and job.config_int({}, "n", 60) == 60
    assert job.config_int({"n": 7}, "n", 60) == 7
    for bad in (0, -1, 2.5, "x"):
        with pytest.raises(ValueError, match="tree.n must be"):
            job.config_int({"n": bad}, "n", 60, 1, "tree")


@pytest.mark.parametrize("override, message", [
    ("train.grad_accum=0", "train.grad_accum must be >= 1, got 0"),
    ("train.batch_size=0", "train.batch_size must be >= 1, got 0"),
    ("train.max_steps=-1", "train.max_steps must be >= 0, got -1"),
    ("train.save_every=-1", "train.save_every must be >= 0, got -1"),
])
def test_training_settings_that_trained_nothing_are_errors(tmp_path, override, message):
    from conftest import compose
    from draftheads.train.loop import make_accelerator

    cfg = compose("medusa", ["logging.wandb=disabled", "train.device=cpu", override])
    with pytest.raises(ValueError, match=message):
        make_accelerator(cfg)


def test_cuda_without_cuda_is_an_error(monkeypatch):
    import torch

    from conftest import compose
    from draftheads.train.loop import make_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="train.device=cuda was asked for but torch sees no CUDA GPU"):
        make_accelerator(compose("medusa", ["train.device=cuda"]))


def test_zero_tree_sizes_are_errors_not_defaults():
    from omegaconf import OmegaConf

    from draftheads.eval.drafters import ranked_static_tree
    from draftheads.eval.eagle_drafter import EagleTreeConfig

    for key in ("nodes", "depth", "top_k"):
        with pytest.raises(ValueError, match=f"tree.{key} must be >= 1, got 0"):
            EagleTreeConfig.from_any({"kind": "dynamic", key: 0})
    assert EagleTreeConfig.from_any({"kind": "dynamic", "nodes": None}).nodes == 60
    with pytest.raises(ValueError, match="tree.max_depth must be >= 1, got 0"):
        ranked_static_tree(OmegaConf.create({"max_depth": 0, "size": 8}), 3, None)
    assert ranked_static_tree(OmegaConf.create({"max_depth": None, "size": 8}), 3, None)[0].max_depth == 3


def test_zero_questions_and_tokens_are_errors(tmp_path):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from draftheads.eval.questions import check_eval_limits, load_questions

    q = tmp_path / "q.jsonl"
    q.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": ["b"]}\n')
    with pytest.raises(ValueError, match="max_questions must be a positive number of questions"):
        load_questions(q, 0)
    assert len(load_questions(q, None)) == 2
    target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024),
                             identity=SimpleNamespace(name="tiny"))
    base = dict(max_new_tokens=16, max_turns=2, max_questions=None, max_prompt_tokens=1536)
    for key in ("max_new_tokens", "max_turns", "max_questions"):
        with pytest.raises(ValueError, match=f"{key} must be >= 1, got 0"):
            check_eval_limits(OmegaConf.create({**base, key: 0}), target)
    with pytest.raises(ValueError, match="sweep.max_questions must be >= 1, got 0"):
        check_eval_limits(OmegaConf.create({**base, "sweep": {"max_questions": 0, "max_new_tokens": 8}}), target)
    for limit in (1536, None):  # above the context, or no limit: capped at the context
        cfg = OmegaConf.create({**base, "max_prompt_tokens": limit})
        check_eval_limits(cfg, target)
        assert cfg.max_prompt_tokens == 1023
    cfg = OmegaConf.create(base | {"max_prompt_tokens": 300})
    check_eval_limits(cfg, target)
    assert cfg.max_prompt_tokens == 300


def test_prompt_longer_than_the_context_is_skipped_and_counted(tiny_target_dir, tmp_path, caplog):
    from conftest import compose
    from draftheads.eval.acceptance import main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": "long", "turns": ["word " * 1100]}) + "\n"
                     + json.dumps({"question_id": "short", "turns": ["hello there"]}) + "\n")
    cfg = compose("eval", ["target=hf", f"target.name={tiny_target_dir}", "target.dtype=fp32",
                           "target.local_files_only=true", f"questions={qfile}", "drafter=plain", "max_new_tokens=4",
                           "max_prompt_tokens=5000", f"out={tmp_path / 'eval.json'}"])
    with caplog.at_level("WARNING"):
        res = main(cfg)
    assert [r["question_id"] for r in res["rows"]] == ["short"]
    assert "max_prompt_tokens=5000 is not below the target's context of 1024 tokens" in caplog.text
    assert "skipped 1 turns with prompts over 1023 tokens" in caplog.text


def test_head_with_nan_or_inf_is_refused_on_load(tmp_path):
    import torch

    from draftheads.heads.checkpoint import read_head, save_head

    good = {"w": torch.ones(3, 4), "steps": torch.arange(3)}
    save_head(tmp_path / "ok", "medusa", {}, {}, good)
    assert read_head(tmp_path / "ok")[1]["w"].shape == (3, 4)
    for bad_value, what in ((float("nan"), "1 NaN and 0 Inf"), (float("inf"), "0 NaN and 1 Inf")):
        w = torch.ones(3, 4)
        w[1, 2] = bad_value
        save_head(tmp_path / "bad", "medusa", {}, {}, {"w": w})
        with pytest.raises(ValueError) as ei:
            read_head(tmp_path / "bad")
        assert str(tmp_path / "bad" / "model.safetensors") in str(ei.value) and "'w'" in str(ei.value)
        assert what in str(ei.value)


def test_atomic_open_replaces_whole_or_not_at_all(tmp_path):
    """A streamed write (the shard merge) that fails midway leaves the old file and no temp file behind."""
    from draftheads.heads.checkpoint import atomic_open

    f = tmp_path / "x.jsonl"
    f.write_text("old\n")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_open(f) as out:
            out.write(b"half of the new")
            raise RuntimeError("killed")
    assert f.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]
    with atomic_open(f) as out:
        out.write(b"new\n")
    assert f.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]


# --------------------------------------------------------------------------- misleading messages

def test_data_path_directory_and_unknown_target_messages(tmp_path):
    from draftheads.data_prep.dataset import DataConfig, _source_identity
    from draftheads.heads.target import TargetConfig
    from draftheads.heads.target_source import resolve_target

    with pytest.raises(IsADirectoryError, match=f"data.path={tmp_path} is a directory; expected a JSON or JSONL"):
        _source_identity(DataConfig(source="file", path=str(tmp_path)))
    with pytest.raises(ValueError) as ei:
        resolve_target(TargetConfig(name="no-such-model-anywhere", local_files_only=True))
    msg = str(ei.value)
    assert "was not found locally" in msg and "runs are offline by default" in msg and "local model directory" in msg
    with pytest.raises(ValueError, match="is not a model directory"):
        resolve_target(TargetConfig(name=str(tmp_path)))


# --------------------------------------------------------------------------- file modes

@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_head_files_follow_the_umask(tmp_path, mask):
    import torch

    from draftheads.heads.checkpoint import save_head

    old = os.umask(mask)
    try:
        save_head(tmp_path / "h", "medusa", {}, {}, {"w": torch.ones(2)})
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "h").iterdir()}
    assert modes == {"model.safetensors": 0o666 & ~mask, "config.json": 0o666 & ~mask,
                     ".draftheads-output.json": 0o666 & ~mask}  # the manifest of what the write owns
    assert (tmp_path / "h").stat().st_mode & 0o777 == 0o777 & ~mask


# --------------------------------------------------------------------------- resume

@pytest.fixture(scope="module")
def trained_medusa(tmp_path_factory, tiny_target_dir, chat_file):
    """A 6-step Medusa run (2 heads) with checkpoints at steps 3 and 6 and the exact per-step losses."""
    from conftest import compose, tiny_train_overrides
    from draftheads.train.medusa import main

    out = tmp_path_factory.mktemp("medusa-run") / "run"
    main(compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, out, **RESUME_KW)))
    return out


RESUME_KW = {"train.save_every": 3, "train.keep_last": 5, "head.num_heads": 2, "train.eval_tokens": 0}


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), steps  # no step logged twice
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _resume(src: Path, dst: Path, tiny_target_dir, chat_file, **extra):
    import shutil

    from conftest import compose, tiny_train_overrides
    from draftheads.train.medusa import main

    if not dst.exists():
        shutil.copytree(src, dst)
    kw = {**RESUME_KW, "train.resume": "true", **extra}
    return main(compose("medusa", tiny_train_overrides(tiny_target_dir, chat_file, dst, **kw)))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["no_trainer_state", "truncated_optimizer"])
def test_resume_falls_back_to_the_newest_complete_checkpoint(trained_medusa, tmp_path, tiny_target_dir, chat_file,
                                                             caplog, damage):
    import shutil

    ref = _losses(trained_medusa)
    dst = tmp_path / "run"
    shutil.copytree(trained_medusa, dst)
    shutil.rmtree(dst / "final")
    newest = dst / "checkpoints" / "step-000006"
    if damage == "no_trainer_state":
        shutil.rmtree(newest / "trainer_state")
        named = f"{newest} has no trainer_state/"
    else:
        opt = newest / "trainer_state" / "optimizer.pt"
        opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
        named = f"{opt} is unreadable or truncated"
    with caplog.at_level("WARNING"):
        _resume(trained_medusa, dst, tiny_target_dir, chat_file)
    assert "resuming from" in caplog.text and "step-000003" in caplog.text and named in caplog.text
    got = _losses(dst)
    assert sorted(got) == list(range(1, 7))
    for s in range(4, 7):  # steps 4..6 retrained from step 3 reproduce the uninterrupted run
        assert got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_resume_with_no_complete_checkpoint_stops_naming_the_files(trained_medusa, tmp_path, tiny_target_dir,
                                                                   chat_file):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(trained_medusa, dst)
    for d in (dst / "checkpoints").iterdir():
        shutil.rmtree(d / "trainer_state")
    with pytest.raises(ValueError) as ei:
        _resume(trained_medusa, dst, tiny_target_dir, chat_file)
    msg = str(ei.value)
    assert "no checkpoint in" in msg and "step-000003 has no trainer_state/" in msg and "step-000006" in msg


@pytest.mark.slow
def test_resume_refuses_other_data_unless_asked(trained_medusa, tmp_path, tiny_target_dir, chat_file, caplog):
    dst = tmp_path / "run"
    with pytest.raises(ValueError, match=r"cannot resume: .* was trained on data 'file' \(prepared-data key \w+"):
        _resume(trained_medusa, dst, tiny_target_dir, chat_file, **{"data.max_length": 48, "train.max_steps": 8})
    with caplog.at_level("WARNING"):
        _resume(trained_medusa, dst, tiny_target_dir, chat_file,
                **{"data.max_length": 48, "train.max_steps": 8, "train.resume_allow_data_change": "true"})
    assert "resuming on different data" in caplog.text
    assert sorted(_losses(dst)) == list(range(1, 9))
    state = json.loads((dst / "checkpoints" / "step-000006" / "trainer_state" / "state.json").read_text())
    assert state["data"]["name"] == "file" and state["data"]["key"]  # recorded in the trainer state


@pytest.mark.slow
def test_resume_with_another_head_config_names_the_key(trained_medusa, tmp_path, tiny_target_dir, chat_file):
    with pytest.raises(ValueError, match=r"head.num_heads=3 here but 2 in the checkpoint"):
        _resume(trained_medusa, tmp_path / "run", tiny_target_dir, chat_file, **{"head.num_heads": 3})



@pytest.mark.slow
def test_every_output_of_a_training_run_follows_the_umask(trained_medusa):
    """Heads, checkpoints, trainer state, metrics, configs: what open()/mkdir() give under the umask, never 0600."""
    mask = os.umask(0)
    os.umask(mask)
    wrong = []
    for p in [trained_medusa, *trained_medusa.rglob("*")]:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        if p.stat().st_mode & 0o777 != want:
            wrong.append(f"{p.relative_to(trained_medusa)}: {oct(p.stat().st_mode & 0o777)}")
    assert (trained_medusa / "final" / "model.safetensors").is_file()
    assert not wrong, wrong

# --------------------------------------------------------------------------- shipped entries end to end

@pytest.mark.slow
def test_shipped_entries_end_user_errors_with_one_line_and_exit_2(tmp_path, tiny_target_dir, chat_file):
    tgt = ["target=hf", f"target.name={tiny_target_dir}", "target.dtype=fp32", "target.local_files_only=true"]
    data = ["data=file", f"data.cache_dir={tmp_path / 'cache'}"]
    cases = [
        ("data_prep/prepare.py", tgt + data + [f"data.path={tmp_path / 'nope.json'}"],
         f"error: data file {tmp_path / 'nope.json'} does not exist"),
        ("train/medusa.py", tgt + data + [f"data.path={chat_file}", f"out_dir={tmp_path / 'run'}",
                                          "logging.wandb=disabled", "train.device=cpu", "train.grad_accum=0"],
         "error: train.grad_accum must be >= 1, got 0"),
        ("eval/exactness.py", ["rounds=-1", "out=null"], "error: rounds must be >= 1, got -1"),
    ]
    for entry, args, message in cases:
        p = run_entry(entry, *args, cwd=tmp_path)
        assert error_line(p) == message, (entry, p.stderr[-2000:])
    # a typo in a key: Hydra's short message, no traceback, exit 2 as well
    p = run_entry("data_prep/prepare.py", *tgt, "data.bogus=1", cwd=tmp_path)
    assert p.returncode == 2 and "Could not override 'data.bogus'" in p.stderr and "Traceback" not in p.stderr
    # the debug switch brings the traceback back
    p = run_entry("eval/exactness.py", "rounds=-1", "out=null", cwd=tmp_path, DRAFTHEADS_DEBUG="1")
    assert p.returncode == 1 and "Traceback" in p.stderr and "ValueError: rounds must be >= 1" in p.stderr
