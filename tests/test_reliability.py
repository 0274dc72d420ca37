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
from heads import job


# --------------------------------------------------------------------------- heads/job.py in-process

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
