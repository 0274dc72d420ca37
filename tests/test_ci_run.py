""".ci/run's speculators step: CI builds the speculators environment or fails saying why, and then requires the
export round trip (DRAFTHEADS_REQUIRE_SPECULATORS=1, so tests/test_export.py fails instead of skipping without it);
CI_SPECULATORS=0 is the local opt-out. The step runs as written in .ci/run, with a stand-in for
scripts/make_speculators_venv.sh (the real one takes minutes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

FAIL = "mkdir -p .venv-spec/bin && echo 'ERROR: No matching distribution found for speculators==0.9.0' >&2; exit 1\n"
BUILD = "mkdir -p .venv-spec/bin && printf '#!/bin/sh\\n' > .venv-spec/bin/python && chmod +x .venv-spec/bin/python\n"


def speculators_step() -> str:
    """The block of .ci/run between the installs and the test command."""
    text = (REPO / ".ci" / "run").read_text()
    start = text.index('if [ "${CI_SPECULATORS')
    return text[start:text.index("\npython -m pytest", start)]


def run_step(tmp: Path, builder: str, **env: str) -> subprocess.CompletedProcess:
    (tmp / "scripts").mkdir(exist_ok=True)
    (tmp / "scripts" / "make_speculators_venv.sh").write_text(f"echo built >> calls\n{builder}")
    script = f"set -euo pipefail\n{speculators_step()}\necho \"required=${{DRAFTHEADS_REQUIRE_SPECULATORS:-unset}}\"\n"
    e = {k: v for k, v in os.environ.items() if k not in ("CI_SPECULATORS", "DRAFTHEADS_REQUIRE_SPECULATORS")}
    return subprocess.run(["bash", "-c", script], cwd=tmp, env={**e, **env}, capture_output=True, text=True,
                          timeout=60)


def test_a_failed_build_fails_ci_and_says_why(tmp_path):
    p = run_step(tmp_path, FAIL)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "No matching distribution" in p.stderr  # the builder's own reason stays visible
    assert ("error: .ci/run: building .venv-spec with scripts/make_speculators_venv.sh failed" in p.stderr
            and "CI_SPECULATORS=0" in p.stderr), p.stderr
    assert "required=" not in p.stdout  # the tests never ran
    assert not (tmp_path / ".venv-spec").exists()  # a half-built environment is not left to look present


@pytest.mark.parametrize("present", [False, True])
def test_a_built_or_present_environment_is_required_by_the_tests(tmp_path, present):
    if present:  # an earlier run's environment: not rebuilt (the builder would fail if called)
        (tmp_path / ".venv-spec" / "bin").mkdir(parents=True)
        (tmp_path / ".venv-spec" / "bin" / "python").write_text("#!/bin/sh\n")
        (tmp_path / ".venv-spec" / "bin" / "python").chmod(0o755)
    p = run_step(tmp_path, FAIL if present else BUILD)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("required=1")
    assert (tmp_path / "calls").exists() is not present


def test_ci_speculators_0_neither_builds_nor_requires(tmp_path):
    p = run_step(tmp_path, FAIL, CI_SPECULATORS="0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("required=unset") and not (tmp_path / "calls").exists()
