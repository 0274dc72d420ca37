"""Run entry scripts in turn inside this one process, as ``python <entry> <args>`` would, and print JSON.

    python tests/entry_runner.py '[["/abs/train/medusa.py", ["optim.lr=0"]], ...]'

For each entry: ``sys.argv`` is set, the file runs as ``__main__`` (runpy), its ``SystemExit`` code is kept (an
escaping exception is printed as Python would, with its traceback, and counts as exit 1), and what it wrote to
stderr is captured. Why one process: starting Python with torch and transformers takes seconds here, so one
launch for every entry keeps tests/test_entries.py's fast check cheap; the slow tier launches each entry alone.
Output: ``{entry: {"code": int, "stderr": str, "seconds": float}}`` on stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import time
import traceback


def run_one(path: str, args: list[str]) -> dict[str, object]:
    err, out = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = [path, *args]
    code: object = 0
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                code = e.code
                if isinstance(code, str):  # Python prints a string exit code on stderr and exits 1
                    print(code, file=sys.stderr)
                    code = 1
                code = 0 if code is None else code
            except BaseException:  # noqa: BLE001 - reported as the interpreter would
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
        try:  # a Hydra entry leaves its global state initialized; the next entry initializes it again
            from hydra.core.global_hydra import GlobalHydra

            GlobalHydra.instance().clear()
        except ImportError:
            pass
    return {"code": code, "stderr": err.getvalue(), "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    cases = json.loads(sys.argv[1])
    results = {path: run_one(path, args) for path, args in cases}
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
