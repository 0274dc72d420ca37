"""Every entry script ends a user error with one line (heads/job.py's promise), checked two ways.

By inspection: every file with an ``if __name__ == "__main__":`` block runs through ``job.cli`` or a function
decorated with ``@job.main``, and nothing uses ``hydra.main`` directly (it would print Hydra's traceback). A new
entry fails here until it uses the wrapper (or is listed in NOT_WRAPPED with the reason).

By running: one representative user error per wrapped entry must exit 2 with one ``error:`` line on stderr and no
traceback. Fast tier: one Python process runs every entry in turn (tests/entry_runner.py; one interpreter start
instead of one per entry). Slow tier: each entry launched as its own process, as a user runs it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE_DIRS = ("data_prep", "eval", "heads", "pipeline", "scripts", "train", "draftheads")

# Entries that do not go through heads/job.py's wrapper, and why. Anything else with a __main__ block must use it.
NOT_WRAPPED = {
    "draftheads/cli.py": "the `draftheads` command: execs a job's own entry (wrapped); its own usage errors are one "
                         "message and exit 2 (tests/test_cli.py)",
    "scripts/speculators_check.py": "runs inside the speculators venv (.venv-spec), which does not install draftheads",
    "scripts/speculators_dflash_check.py": "runs inside the speculators venv (.venv-spec), which does not install "
                                           "draftheads",
    "scripts/config_reference.py": "regenerates docs/configuration.md from conf/; takes no user input",
    "scripts/bench_allocator.py": "benchmark; its argument errors are one 'error:' line of its own (exit 1), tested in "
                                  "tests/test_bench_allocator.py",
    "scripts/bench_ceiling_procs.py": "benchmark; turns its ValueError into one 'error:' line itself (exit 1)",
    "scripts/bench_distill.py": "benchmark (argparse only); not wrapped yet",
    "scripts/bench_draft.py": "benchmark; not wrapped yet (a bad --steps ends in a ValueError traceback)",
    "scripts/bench_memory.py": "benchmark (argparse only); each cell runs a real training entry in a child process",
}

# One representative user error per wrapped entry: arguments, and what its one error line must say. {tmp} is a
# fresh empty folder (also the working directory). Errors are ones raised before any model loads.
CASES: dict[str, tuple[list[str], str]] = {
    "data_prep/prepare.py": (["data.truncation=cut"], "error: data.truncation=cut is not allowed; allowed: truncate"),
    "data_prep/distill.py": (["refill=both"], "error: refill must be merged or separate, got 'both'"),
    "data_prep/features.py": (["batch_size=0"], "error: batch_size must be >= 1, got 0"),
    "data_prep/distill_merge.py": (["only-one-arg"], "error: usage: python -m draftheads.data_prep.distill_merge OUT N"),
    "train/medusa.py": (["optim.lr=0"], "error: optim.lr=0.0 is not allowed: a learning rate must be > 0"),
    "train/eagle.py": (["optim.schedule=step"], "error: optim.schedule=step is not allowed; allowed: cosine"),
    "train/eagle3.py": (["train.mixed_precision=fp8"], "error: train.mixed_precision=fp8 is not allowed"),
    "train/block.py": (["optim.lr=-1"], "error: optim.lr=-1.0 is not allowed: a learning rate must be > 0"),
    "eval/acceptance.py": (["tree.kind=bushy"], "error: tree.kind=bushy is not allowed; allowed: auto, static"),
    "eval/measure.py": (["tree.top_k=0"], "error: tree.top_k=0 is out of range"),
    "eval/exactness.py": (["rounds=-1", "out=null"], "error: rounds must be >= 1, got -1"),
    "eval/report.py": (["{tmp}/nope.json"], "error: [Errno 2] No such file or directory: '{tmp}/nope.json'"),
    "scripts/export.py": (["format=onnx"], "error: format must be one of ('speculators', 'sglang'), got 'onnx'"),
    "scripts/publish.py": (["checkpoint={tmp}/nope"], "error: head checkpoint {tmp}/nope does not exist"),
    "scripts/compare.py": (["{tmp}/nope.json"], "error: [Errno 2] No such file or directory: '{tmp}/nope.json'"),
    "scripts/bench_loss.py": (["--batch", "0"], "error: --batch, --repeats must be >= 1 and --length >= 3, got 0, 4, 512"),
    "scripts/paired_tau.py": (["a", "b"], "error: expected RUN:METHOD (e.g. runs/measure/x:eagle)"),
    "scripts/plot_run.py": (["{tmp}/nope"], "error: {tmp}/nope/metrics.jsonl does not exist"),
    "scripts/plot_runs.py": (["{tmp}/nope:x", "out={tmp}/x.png"], "error: {tmp}/nope: no results.json"),
    "scripts/sweep_report.py": (["{tmp}/nope"], "error: sweep directory {tmp}/nope does not exist"),
    "scripts/vocab_coverage.py": (["sizes=8192"], "error: sizes must be a list of integers like [8192,32000]"),
    "scripts/eagle3_rollout_eval.py": (["{tmp}", "3"], "error: {tmp} is not a head checkpoint directory"),
    "scripts/bench_launch.py": (["--global-batch", "7", "--processes", "2"],
                                "error: --global-batch must be divisible by --processes"),
    "scripts/bench_decode_attn.py": (["--kernel", "--keys", "0"], "error: --keys must be >= 1, got 0"),
    "scripts/bench_verify_cost.py": (["--context", "0"], "error: --context 0, --repeats 7 and every --widths value "
                                                         "[1, 2, 4, 8, 16, 32, 64] must be at least 1"),
}

# Wrapped entries without a cheap user error to run (each would time or train something first).
NOT_RUN = {
    "scripts/bench_dtype.py": "checks no argument (--tokens 0 ends in a ZeroDivisionError traceback)",
    "scripts/bench_features.py": "benchmark: argparse only",
    "scripts/bench_medusa.py": "benchmark: argparse only",
    "scripts/bench_ttt.py": "benchmark: re-execs itself first (allocator setting)",
    "scripts/reliability_table.py": "runs training jobs; argparse only",
    "scripts/arch_matrix_table.py": "renders a committed table; --run trains heads for the architecture matrix",
}


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def _is_job_attr(node: ast.AST, attr: str) -> bool:
    """``job.<attr>`` (heads/job.py imported as ``job``)."""
    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) \
        and node.value.id == "job"


def entry_kind(tree: ast.Module) -> str | None:
    """How a module's __main__ block ends user errors: "job.main", "job.cli", "bare" (neither), or None (no block)."""
    guards = [n for n in tree.body if _is_main_guard(n)]
    if not guards:
        return None
    wrapped = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
               and any(isinstance(d, ast.Call) and _is_job_attr(d.func, "main") for d in n.decorator_list)}
    calls = [c for g in guards for c in ast.walk(g) if isinstance(c, ast.Call)]
    if any(_is_job_attr(c.func, "cli") for c in calls):
        return "job.cli"
    if any(isinstance(c.func, ast.Name) and c.func.id in wrapped for c in calls):
        return "job.main"
    return "bare"


def uses_hydra_main(tree: ast.Module) -> bool:
    """``hydra.main`` used or imported (``@hydra.main(...)``, ``from hydra import main``)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr == "main" and isinstance(n.value, ast.Name) and n.value.id == "hydra":
            return True
        if isinstance(n, ast.ImportFrom) and n.module == "hydra" and any(a.name == "main" for a in n.names):
            return True
    return False


def _modules() -> dict[str, ast.Module]:
    """Parsed source of every file that mentions __main__ or hydra (the others cannot be entries or use hydra.main)."""
    out = {}
    for d in PACKAGE_DIRS:
        for p in sorted((REPO / d).rglob("*.py")):
            text = p.read_text()
            if "__main__" in text or "hydra" in text:
                out[str(p.relative_to(REPO))] = ast.parse(text, str(p))
    return out


def test_every_entry_goes_through_the_one_line_wrapper():
    modules = _modules()
    entries = {name: kind for name, tree in modules.items() if (kind := entry_kind(tree)) is not None}
    hydra_entries = {e for e, k in entries.items() if k == "job.main"}
    # the shipped Hydra jobs (every trainer and eval job among them) are found as job.main entries
    assert {"train/medusa.py", "train/eagle.py", "train/eagle3.py", "data_prep/prepare.py", "data_prep/distill.py",
            "data_prep/features.py", "eval/acceptance.py", "eval/measure.py", "eval/exactness.py", "scripts/export.py",
            "scripts/publish.py"} <= hydra_entries
    bare = {e for e, k in entries.items() if k == "bare"}
    assert bare == set(NOT_WRAPPED), ("entries without job.main/job.cli (use heads/job.py's wrapper, or list one "
                                      "in NOT_WRAPPED with the reason)", sorted(bare ^ set(NOT_WRAPPED)))
    direct = [name for name, tree in modules.items() if uses_hydra_main(tree)]
    assert direct == ["heads/job.py"], ("bare hydra.main prints a traceback for a user error; use @job.main", direct)
    # every wrapped entry has a user error that the runtime checks below exercise, or says why not
    wrapped = {e for e, k in entries.items() if k != "bare"}
    assert wrapped == set(CASES) | set(NOT_RUN), sorted(wrapped ^ (set(CASES) | set(NOT_RUN)))


def test_inspection_tells_the_forms_apart():
    """The checks above on hand-written entries: both wrapped forms, a bare hydra.main, a plain main()."""
    forms = {
        "wrapped_main": ("from draftheads.heads import job\n@job.main(config_name='x')\ndef run(cfg):\n    pass\n"
                         "if __name__ == '__main__':\n    run()\n", "job.main", False),
        "wrapped_cli": ("from draftheads.heads import job\ndef main():\n    pass\n"
                        "if __name__ == '__main__':\n    job.cli(main)\n", "job.cli", False),
        "bare_hydra": ("import hydra\n@hydra.main(version_base=None, config_path='../conf', config_name='x')\n"
                       "def run(cfg):\n    pass\nif __name__ == '__main__':\n    run()\n", "bare", True),
        "hydra_import": ("from hydra import main\n@main(config_name='x')\ndef run(cfg):\n    pass\n"
                         "if __name__ == '__main__':\n    run()\n", "bare", True),
        "plain": ("def main():\n    pass\nif __name__ == '__main__':\n    main()\n", "bare", False),
        "library": ("def f():\n    pass\n", None, False),
    }
    for name, (src, kind, hydra) in forms.items():
        tree = ast.parse(src)
        assert (entry_kind(tree), uses_hydra_main(tree)) == (kind, hydra), name


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", DRAFTHEADS_CACHE=str(tmp / "cache"))
    for k in ("HYDRA_FULL_ERROR", "DRAFTHEADS_DEBUG"):  # they would turn the one line back into a traceback
        env.pop(k, None)
    return env


def _check(entry: str, code: object, stderr: str, tmp: Path) -> None:
    want = CASES[entry][1].format(tmp=tmp)
    assert code == 2, (entry, code, stderr[-2000:])
    assert "Traceback" not in stderr, (entry, stderr[-2000:])
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(want), (entry, want, stderr[-2000:])


def test_each_entry_ends_a_user_error_with_one_line_in_one_process(tmp_path):
    cases = [[str(REPO / e), [a.format(tmp=tmp_path) for a in args]] for e, (args, _) in CASES.items()]
    p = subprocess.run([sys.executable, str(REPO / "tests" / "entry_runner.py"), json.dumps(cases)], cwd=tmp_path,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.splitlines()[-1])
    assert set(results) == {str(REPO / e) for e in CASES}
    for entry in CASES:
        r = results[str(REPO / entry)]
        _check(entry, r["code"], r["stderr"], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(CASES))
def test_each_entry_ends_a_user_error_with_one_line_as_a_process(entry, tmp_path):
    args = [a.format(tmp=tmp_path) for a in CASES[entry][0]]
    p = subprocess.run([sys.executable, str(REPO / entry), *args], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    _check(entry, p.returncode, p.stderr, tmp_path)
