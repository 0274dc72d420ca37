"""The ``draftheads`` command: one subcommand per job, each running the same entry file users run by path.

Why a dispatcher and not a re-implementation: every job is a Hydra entry (``python train/medusa.py k=v``) that
tests, sweeps (``-m``) and ``accelerate launch`` use directly. The command only finds that file and replaces
this process with it, so overrides, Hydra flags (``--help``, ``--cfg job``, ``-m``), exit codes and signals
behave exactly as when the file is run by hand.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from draftheads.heads import registry

# subcommand -> (module of the entry file, one line for --help)
JOBS: dict[str, tuple[str, str]] = {
    "prepare": ("draftheads.data_prep.prepare", "conversations -> split, chat template, loss masks -> Arrow cache"),
    "distill": ("draftheads.data_prep.distill", "the frozen target rewrites assistant turns (self-distillation)"),
    "features": ("draftheads.data_prep.features", "capture target hidden states once for offline training"),
    "eval": ("draftheads.eval.acceptance", "speculative decoding with one head: tau, acceptance by depth, identity"),
    "measure": ("draftheads.eval.measure", "every method side by side: tau, tokens/s, latency profile, speedup"),
    "exactness": ("draftheads.eval.exactness", "chi-square/TV check of the exact verification rule"),
    "export": ("draftheads.scripts.export", "EAGLE-3 export for vLLM speculators / SGLang"),
    "publish": ("draftheads.scripts.publish", "a Hub-layout folder with model card and tau table"),
}
COMPARE = ("draftheads.scripts", "compare_families.sh", "distill, train all three families, measure them in one run")


def usage() -> str:
    rows = [(name, help_) for name, (_, help_) in JOBS.items()]
    rows.insert(3, (f"train {{{'|'.join(registry.FAMILIES)}}}", "train a draft head on the frozen target"))
    rows.append(("compare", COMPARE[2]))
    width = max(len(name) for name, _ in rows)
    lines = ["usage: draftheads <command> [hydra overrides | --help | --cfg job | -m ...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, help_ in rows]
    lines += ["", "Each command runs the entry file of the same job (e.g. `draftheads train medusa` = "
              "`python train/medusa.py`);", "`draftheads <command> --help` shows that job's config."]
    return "\n".join(lines)


def entry_file(module: str) -> Path:
    """The file behind ``module`` (found without importing it: entry modules run jobs at import in places)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"draftheads is installed without {module}"
    return Path(spec.origin)


def resolve(argv: list[str]) -> list[str]:
    """The command line that runs the job ``argv`` names: [program, file, *overrides]. ValueError if unknown."""
    if not argv:
        raise ValueError("no command given")
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        if not rest or rest[0] not in registry.FAMILIES:
            got = repr(rest[0]) if rest else "nothing"
            raise ValueError(f"'draftheads train' needs a family, got {got}; allowed: {', '.join(registry.FAMILIES)}")
        return [sys.executable, str(entry_file(registry.get(rest[0]).trainer)), *rest[1:]]
    if cmd == "compare":
        pkg, name, _ = COMPARE
        return ["bash", str(entry_file(pkg).parent / name), *rest]
    if cmd not in JOBS:
        raise ValueError(f"unknown command {cmd!r}; allowed: {', '.join([*JOBS, 'train', 'compare'])}")
    return [sys.executable, str(entry_file(JOBS[cmd][0])), *rest]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    try:
        cmd = resolve(argv)
    except ValueError as e:
        print(f"draftheads: {e}\n\n{usage()}", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)  # never returns: the job's exit code is the command's


if __name__ == "__main__":
    sys.exit(main())
