"""The `draftheads` command finds each job's entry file and hands the command line to it unchanged."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftheads import cli

REPO = Path(__file__).resolve().parents[1]


def test_every_command_resolves_to_its_entry_file() -> None:
    for name, (module, _) in cli.JOBS.items():
        cmd = cli.resolve([name, "a=1"])
        assert cmd[0] == sys.executable and cmd[2:] == ["a=1"]
        assert Path(cmd[1]) == REPO / (module.removeprefix("draftheads.").replace(".", "/") + ".py"), name
    for fam in cli.registry.FAMILIES:
        assert Path(cli.resolve(["train", fam, "train.max_steps=3"])[1]) == REPO / "train" / f"{fam}.py"
    assert cli.resolve(["compare", "STEPS=2"])[1:] == [str(REPO / "scripts" / "compare_families.sh"), "STEPS=2"]


def test_one_namespace_installed_without_top_level_job_folders(tmp_path: Path) -> None:
    """The job folders install as draftheads.<folder> only: from outside the checkout, `train` or `eval` is not
    importable (nothing that generic lands in site-packages), while draftheads.train.loop is."""
    code = ("import importlib.util as u; print([u.find_spec(m) is None for m in "
            "('train', 'eval', 'heads', 'data_prep', 'pipeline', 'scripts')]); import draftheads.train.loop")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([True] * 6)


def test_help_lists_every_command() -> None:
    text = cli.usage()
    for name in [*cli.JOBS, "compare"]:
        assert f"\n  {name} " in text
    assert "train {medusa|eagle|eagle3|block}" in text


@pytest.mark.parametrize("argv, needle", [(["trian"], "unknown command 'trian'"),
                                          (["train"], "needs a family, got nothing"),
                                          (["train", "gpt"], "needs a family, got 'gpt'; allowed: medusa, eagle, eagle3, block")])
def test_bad_command_is_one_message_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_command_passes_hydra_flags_through() -> None:
    """`draftheads prepare --cfg job data.max_length=77` prints the prepare job's composed config."""
    out = subprocess.run([sys.executable, "-m", "draftheads.cli", "prepare", "--cfg", "job", "data.max_length=77"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "max_length: 77" in out.stdout and "target:" in out.stdout


def test_run_tree_kills_the_grandchildren_of_a_timed_out_command(tmp_path: Path) -> None:
    """The helper the script tests use: a timed-out recipe must not leave its trainers running."""
    from conftest import run_tree

    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout=2)
    pid = int(pid_file.read_text())

    def gone() -> bool:  # dead, a zombie nobody reaped yet, or its pid already reused by another program
        try:
            stat, cmd = Path(f"/proc/{pid}/stat").read_text(), Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return True
        return stat.split()[2] == "Z" or not cmd.startswith(b"sleep")

    deadline = time.monotonic() + 10  # SIGKILL is delivered at once but a busy host may take a moment to end it
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()
    done = run_tree(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
