"""A job writes only what it owns: export and publish never empty a folder they did not write, the source head
and its run are never outputs, one writer per output (a dead holder's lock is taken over), disk errors at an
output are one-line user errors, and configs that cannot be right stop before any model loads."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import REPO, compose
from draftheads.heads import job, outputs
from draftheads.heads.checkpoint import atomic_dir, save_head


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: 'kept byte for byte' is this dict unchanged."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _user_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("my notes\n")
    (root / "sub").mkdir()
    (root / "sub" / "data.bin").write_bytes(os.urandom(64))
    return root


def _write(out: Path, owner: str | None, files: dict[str, str]) -> None:
    with atomic_dir(out, owner=owner) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)


# ------------------------------------------------------------------ the atomic-folder helper

def test_atomic_dir_never_removes_files_it_did_not_write(tmp_path):
    user = _user_folder(tmp_path / "mine")
    before = _snapshot(user)
    for owner in ("export", "publish", None):
        with pytest.raises(ValueError, match="did not write"):
            _write(user, owner, {"config.json": "{}"})
        assert _snapshot(user) == before  # kept byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp folder left beside it

    out = tmp_path / "exp"
    _write(out, "export", {"config.json": "1", "model.safetensors": "a"})
    assert outputs.read_manifest(out)["job"] == "export"
    assert outputs.read_manifest(out)["files"] == ["config.json", "model.safetensors"]
    _write(out, "export", {"config.json": "2", "model.safetensors": "b"})  # its own earlier output: replaced
    assert (out / "config.json").read_text() == "2"
    with pytest.raises(ValueError, match="holds a export output, not a publish one"):
        _write(out, "publish", {"README.md": "x"})
    (out / "my_readme.md").write_text("added by the user")
    with pytest.raises(ValueError, match=r"earlier export output plus 1 file\(s\) this job did not write \(my_readme"):
        _write(out, "export", {"config.json": "3", "model.safetensors": "c"})
    assert (out / "my_readme.md").read_text() == "added by the user" and (out / "config.json").read_text() == "2"


def test_internal_folders_from_before_manifests_are_replaced_only_when_same_files(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("old")
    (final / "model.safetensors").write_text("old")
    _write(final, None, {"config.json": "new", "model.safetensors": "new"})  # a run's final/ written before manifests
    assert (final / "config.json").read_text() == "new"
    (final / "user.txt").write_text("keep me")
    os.remove(final / outputs.MANIFEST)
    with pytest.raises(ValueError, match="user.txt"):
        _write(final, None, {"config.json": "newer", "model.safetensors": "newer"})
    assert (final / "user.txt").read_text() == "keep me" and (final / "config.json").read_text() == "new"


def test_a_file_where_the_folder_goes_is_refused_and_kept(tmp_path):
    f = tmp_path / "out"
    f.write_text("a file")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        _write(f, "export", {"a": "b"})
    assert f.read_text() == "a file"


# ------------------------------------------------------------------ export and publish, as jobs

def _head(tmp_path: Path) -> tuple[Path, Path]:
    """A run folder holding a head checkpoint in final/ (a training run's layout)."""
    run = tmp_path / "run"
    save_head(run / "final", "medusa", {"num_heads": 1}, {"name": "t"}, {"w": torch.ones(2, 2)})
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("target:\n  name: t\n")
    return run, run / "final"


@pytest.mark.parametrize("where", ["checkpoint", "run"])
def test_export_refuses_the_checkpoint_and_its_run_before_loading(tmp_path, where):
    from draftheads.scripts.export import main

    run, ckpt = _head(tmp_path)
    before = _snapshot(run)
    out = ckpt if where == "checkpoint" else run
    cfg = compose("export", [f"checkpoint={ckpt}", f"out={out}", "target.name=/nonexistent"])
    with pytest.raises(ValueError, match="would replace the head checkpoint"):
        main(cfg)  # refused before the (nonexistent) target is looked up
    assert _snapshot(run) == before


def test_export_refuses_a_user_folder_and_an_earlier_export_unless_asked(tmp_path):
    from draftheads.scripts.export import main

    _, ckpt = _head(tmp_path)
    user = _user_folder(tmp_path / "mine")
    before = _snapshot(user)
    with pytest.raises(ValueError, match=r"mine already holds 2 file\(s\) this job did not write"):
        main(compose("export", [f"checkpoint={ckpt}", f"out={user}", "target.name=/nonexistent"]))
    assert _snapshot(user) == before
    earlier = tmp_path / "exp"
    _write(earlier, "export", {"config.json": "{}", "model.safetensors": "x"})
    with pytest.raises(ValueError, match="holds an earlier export output .*pass overwrite=true"):
        main(compose("export", [f"checkpoint={ckpt}", f"out={earlier}", "target.name=/nonexistent"]))
    with pytest.raises((ValueError, OSError)) as ei:  # asked: the ownership check passes, the job goes on (to the target)
        main(compose("export", [f"checkpoint={ckpt}", f"out={earlier}", "overwrite=true", "target.name=/nonexistent"]))
    assert "overwrite" not in str(ei.value) and "did not write" not in str(ei.value)


def test_publish_writes_its_folder_and_replaces_only_its_own(tmp_path):
    from draftheads.scripts.publish import main

    run, ckpt = _head(tmp_path)
    run_before = _snapshot(run)
    base = [f"checkpoint={ckpt}", "verify_load=false"]
    with pytest.raises(ValueError, match="would replace the training run"):
        main(compose("publish", base + [f"out={run}"]))
    user = _user_folder(tmp_path / "mine")
    user_before = _snapshot(user)
    with pytest.raises(ValueError, match="did not write"):
        main(compose("publish", base + [f"out={user}"]))
    assert _snapshot(run) == run_before and _snapshot(user) == user_before

    hub = tmp_path / "hub"
    r = main(compose("publish", base + [f"out={hub}"]))
    assert outputs.MANIFEST not in r["files"] and "README.md" in r["files"]
    assert outputs.read_manifest(hub)["job"] == "publish"
    with pytest.raises(ValueError, match="pass overwrite=true"):
        main(compose("publish", base + [f"out={hub}"]))
    main(compose("publish", base + [f"out={hub}", "overwrite=true"]))
    assert _snapshot(run) == run_before


# ------------------------------------------------------------------ one writer per output

_HOLDER = textwrap.dedent("""
    import sys, time
    from draftheads.heads import outputs
    outputs.claim(sys.argv[1], "training")
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"being written by another job: training \(pid {p.pid} on "):
            outputs.claim(out, "export")
    finally:
        p.kill()  # SIGKILL: no atexit, the lock file stays behind
        p.wait()
    assert outputs.lock_path(out).is_file()
    lock = outputs.claim(out, "export")
    assert f"taking over the lock {outputs.lock_path(out)}" in capsys.readouterr().err
    assert json.loads(outputs.lock_path(out).read_text())["pid"] == os.getpid()
    lock.release()
    assert not outputs.lock_path(out).exists()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path, capsys):
    out = tmp_path / "o"
    out.parent.mkdir(exist_ok=True)
    # pid 1 is alive, but not the process that took the lock (its start time differs)
    outputs.lock_path(out).write_text(json.dumps({"job": "distill", "pid": 1, "host": socket.gethostname(),
                                                  "start_ticks": -5, "since": "earlier"}))
    outputs.claim(out, "features").release()
    assert "no longer running" in capsys.readouterr().err


def test_training_into_a_folder_another_job_holds_is_refused(tmp_path):
    from draftheads.train.run import resolve_out_dir

    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="being written by another job"):
            resolve_out_dir(compose("medusa", [f"out_dir={out}"]))
    finally:
        p.kill()
        p.wait()
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ValueError, match="out_dir=.*afile is a file, not a folder"):
        resolve_out_dir(compose("medusa", [f"out_dir={f}"]))


def test_distill_and_features_refuse_a_held_output_and_features_a_user_folder(tmp_path):
    from draftheads.data_prep.distill import main as distill
    from draftheads.data_prep.features import main as features

    jsonl = tmp_path / "d" / "distilled.jsonl"
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(jsonl)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="distilled.jsonl is being written by another job"):
            distill(compose("distill", [f"out={jsonl}", "target.name=/nonexistent"]))  # refused before any load
    finally:
        p.kill()
        p.wait()
    with pytest.raises(ValueError, match="is a folder; distill writes a JSONL file"):
        distill(compose("distill", [f"out={tmp_path}", "target.name=/nonexistent"]))
    user = _user_folder(tmp_path / "mine")
    before = _snapshot(user)
    with pytest.raises(ValueError, match=r"holds 2 file\(s\) that are not a feature cache \(notes.txt, sub\)"):
        features(compose("features", [f"out={user}", "target.name=/nonexistent"]))
    assert _snapshot(user) == before


# ------------------------------------------------------------------ disk errors are user errors

@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"),
                                        (errno.EACCES, "no permission"), (errno.ENOTDIR, "a file stands where")])
def test_os_errors_at_an_output_are_one_line(code, words, capsys, monkeypatch):
    monkeypatch.delenv("DRAFTHEADS_DEBUG", raising=False)

    def write():
        raise OSError(code, os.strerror(code), "/data/runs/x/model.safetensors")
    with pytest.raises(SystemExit) as ei:
        job.guarded(write)()
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: cannot use /data/runs/x/model.safetensors: ") and words in err


def test_a_bug_raising_oserror_keeps_its_traceback():
    def bug():
        raise OSError(errno.EBADF, "Bad file descriptor")
    with pytest.raises(OSError):
        job.guarded(bug)()


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from draftheads.heads import job
    from draftheads.heads.checkpoint import save_head
    if sys.argv[2] == "limit":  # a file-size limit fails writes like a full disk does (EFBIG instead of ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    job.cli(lambda: save_head(sys.argv[1], "medusa", {}, {}, {"w": torch.ones(100_000)}))
""")


@pytest.mark.slow
def test_a_failed_write_is_one_line_leaves_nothing_and_the_rerun_completes(tmp_path):
    out = tmp_path / "head"
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(out), "limit"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: cannot use ") and "File too large" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and str(tmp_path) in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written: no folder, no temp folder
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(out), "free"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", outputs.MANIFEST])


# ------------------------------------------------------------------ configs that cannot be right

@pytest.mark.parametrize("override,match", [
    ("optim.lr=0", r"optim.lr=0.0 is not allowed: a learning rate must be > 0"),
    ("optim.lr=-1e-3", r"optim.lr=-0.001 is not allowed"),
    ("tree.top_k=100000", r"tree.top_k=100000 is out of range: .* \[1, 64\]"),
    ("tree.size=1000000", r"tree.size=1000000 is out of range"),
])
def test_out_of_range_settings_are_refused_at_composition(override, match):
    from draftheads.heads.schema import check

    name = "measure" if override.startswith("tree") else "medusa"
    with pytest.raises(ValueError, match=match):
        check(compose(name, [override]))
    check(compose(name, []))  # the shipped defaults pass


@pytest.mark.parametrize("entry,override,match", [
    ("medusa", "head=eagle3", r"head=eagle3 does not belong to medusa: it sets head keys \['aux_layers'"),
    ("eagle3", "+experiment=medusa_full", r"\+experiment=medusa_full does not belong to eagle3"),
])
def test_a_group_option_of_another_family_is_refused_naming_the_key(entry, override, match):
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        full = hcompose(config_name=entry, overrides=[override], return_hydra_config=True)
    HydraConfig.instance().set_config(full)  # what a Hydra run has: the options it chose
    try:
        with pytest.raises(ValueError, match=match):
            job.check_own_groups(compose(entry, [override]), Path(CONF), entry)
        job.check_own_groups(compose(entry, []), Path(CONF), entry)
    finally:
        HydraConfig.instance().cfg = None  # other tests resolve paths as outside a Hydra run


def test_an_empty_held_out_split_names_its_cause(tmp_path):
    from draftheads.eval.questions import load_questions

    (tmp_path / "heldout_questions.jsonl").write_text("")
    (tmp_path / "stats.json").write_text(json.dumps({
        "config": {"name": "mychats", "heldout_fraction": 0.0, "max_conversations": None},
        "split": {"train_conversations": 40, "heldout_conversations": 0}}))
    with pytest.raises(ValueError, match=r"held-out split of data 'mychats', which is empty \(data.heldout_fraction="
                                         r"0.0 of 40 conversations"):
        load_questions(tmp_path / "heldout_questions.jsonl")
