"""Try kinds of bad input against the real entry points and write the table of docs/reliability.md.

    PYTHONPATH=. python scripts/reliability_table.py [--out docs/reliability.md] [--only SUBSTRING]

Every case runs one entry (prepare, distill, features, train, eval, measure, exactness, export, publish, a
script) in a subprocess, offline, on a tiny random Llama target and small files built here (the test suite's
fixtures), and records its exit code and what it says: the single ``error:`` line of a user error, or the
warning/summary line of an input that is accepted with a loud note. The script fails (exit 1) when a case ends
differently from what the table promises (exit code, or a traceback where none belongs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    group: str
    kind: str  # the bad input, in words
    entry: str  # path under the repo
    args: list[str]
    expect: int  # exit code the case must end with
    show: str | list[str] | None = None  # exit 0: regex(es) of the line(s) to report (the warning, the counts)
    needs: list[str] = field(default_factory=list)  # workspace assets the case uses ("run")


def _write_assets(ws: Path) -> dict[str, Path]:
    """Tiny target, chats, question files and broken data files."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import CHATML, make_tokenizer, synthetic_conversations, tiny_model  # noqa: E402

    a: dict[str, Path] = {}
    a["target"] = ws / "tiny-llama"
    tiny_model("llama").save_pretrained(a["target"])
    make_tokenizer(CHATML).save_pretrained(a["target"])
    convs = synthetic_conversations(240)
    a["chats"] = ws / "chats.jsonl"
    a["chats"].write_text("".join(json.dumps(c) + "\n" for c in convs))
    recs = convs[:6]
    pretty = json.dumps(recs, indent=2)
    a["broken_end"] = ws / "broken_end.json"  # record 2 lost its closing brace: the error is after the newline
    end2 = pretty.index("}", pretty.index(recs[2]["conversations"][1]["value"]) + 5)
    a["broken_end"].write_text(pretty[:end2] + pretty[end2 + 1:])
    a["comment"] = ws / "comment.json"
    first3 = pretty.index('{\n    "id": "conv-3"')
    a["comment"].write_text(pretty[:first3] + "// a comment someone left here\n  " + pretty[first3:])
    a["minified"] = ws / "minified.json"
    a["minified"].write_text(json.dumps(recs).replace('"id": "conv-1"', '"id": "conv-1" oops', 1))
    a["bad_byte"] = ws / "bad_byte.json"
    at = pretty.index(recs[4]["conversations"][1]["value"]) + 2
    a["bad_byte"].write_bytes(pretty[:at].encode() + b"\xff" + pretty[at:].encode())
    a["bad_line"] = ws / "bad_line.jsonl"
    lines = [json.dumps(r) for r in recs]
    lines[3] = lines[3][:-9]
    a["bad_line"].write_text("\n".join(lines) + "\n")
    a["cut"] = ws / "cut.json"
    a["cut"].write_text(pretty[:pretty.index('"id": "conv-5"') + 20])
    a["empty"] = ws / "empty.json"
    a["empty"].write_text("\n")
    a["no_usable"] = ws / "no_usable.json"
    a["no_usable"].write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": "hi"}]}
                                          for i in range(5)]))
    a["questions"] = ws / "questions.jsonl"
    a["questions"].write_text(json.dumps({"question_id": "q1", "turns": ["count from one"]}) + "\n"
                              + json.dumps({"question_id": "q2", "turns": ["please list red blue"]}) + "\n")
    a["long_questions"] = ws / "long_questions.jsonl"
    a["long_questions"].write_text(json.dumps({"question_id": "long", "turns": ["word " * 1100]}) + "\n"
                                   + json.dumps({"question_id": "short", "turns": ["hello there"]}) + "\n")
    (ws / "a_directory").mkdir()
    (ws / "not_a_model").mkdir()
    return a


def _env(ws: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", DRAFTHEADS_CACHE=str(ws / "cache"), PYTHONUNBUFFERED="1")
    for k in ("HYDRA_FULL_ERROR", "DRAFTHEADS_DEBUG"):
        env.pop(k, None)
    return env


def _run(ws: Path, entry: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / entry), *args], cwd=ws, env=_env(ws), capture_output=True,
                          text=True, timeout=timeout)


def _train_run(ws: Path, a: dict[str, Path]) -> Path:
    """A 6-step Medusa run with checkpoints at steps 3 and 6: the resume cases damage copies of it."""
    out = ws / "run"
    p = _run(ws, "train/medusa.py", _tgt(a) + _data(a, ws) + [f"out_dir={out}", "logging.wandb=disabled",
             "train.device=cpu", "train.mixed_precision=no", "train.batch_size=8", "train.max_steps=6",
             "train.save_every=3", "train.keep_last=5", "train.log_every=1", "head.num_heads=2",
             "train.eval_tokens=0", "optim.warmup_steps=0"])
    if p.returncode != 0:
        raise SystemExit(f"the reference training run failed:\n{p.stderr[-3000:]}")
    import torch
    from safetensors.torch import load_file, save_file

    nan = ws / "nan-head"
    shutil.copytree(out / "final", nan)
    t = load_file(str(nan / "model.safetensors"))
    k = sorted(t)[0]
    t[k] = t[k].clone()
    t[k].view(-1)[0] = float("nan")
    save_file(t, str(nan / "model.safetensors"))
    for name, damage in (("no_state", "trainer_state"), ("trunc_opt", "optimizer"), ("none_complete", "all")):
        d = ws / f"run-{name}"
        shutil.copytree(out, d)
        shutil.rmtree(d / "final")
        newest = d / "checkpoints" / "step-000006"
        if damage == "trainer_state":
            shutil.rmtree(newest / "trainer_state")
        elif damage == "optimizer":
            f = newest / "trainer_state" / "optimizer.pt"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        else:
            for c in (d / "checkpoints").iterdir():
                shutil.rmtree(c / "trainer_state")
    for name in ("other_data", "other_heads", "rerun"):
        shutil.copytree(out, ws / f"run-{name}")
    from draftheads.heads.eagle import EagleDraft, eagle_config_for
    from draftheads.heads.target import load_target

    tgt = load_target({"name": str(a["target"]), "dtype": "fp32", "local_files_only": True})
    torch.manual_seed(0)
    EagleDraft(eagle_config_for(tgt), tgt).save_pretrained(ws / "eagle-head", tgt.identity)  # untrained, loadable
    _output_assets(ws, out)
    return out


def _output_assets(ws: Path, run: Path) -> None:
    """What the output cases need: a user's folder, an earlier publish folder, a run folder whose lock a live
    process holds (this script) and one whose lock a finished process left behind."""
    import socket

    from draftheads.heads.outputs import _start_ticks, lock_path

    mine = ws / "my-folder"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own notes\n")
    p = _run(ws, "scripts/publish.py", [f"checkpoint={run / 'final'}", f"out={ws / 'hub'}", "verify_load=false"])
    if p.returncode != 0:
        raise SystemExit(f"the reference publish failed:\n{p.stderr[-3000:]}")
    for name, pid in (("run-held", os.getpid()), ("run-stale", _dead_pid())):
        lock = lock_path(ws / name)
        lock.write_text(json.dumps({"job": "training", "pid": pid, "host": socket.gethostname(),
                                    "start_ticks": _start_ticks(pid), "since": "2026-12-06T00:00:00+0000"}))
    (ws / "a_file").write_text("not a folder\n")
    (ws / "roles.json").write_text(json.dumps(
        [{"id": "r1", "conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"},
                                        {"from": "gpt", "value": "hello"}]}]
        + [{"id": f"ok{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(9)]))


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def _tgt(a: dict[str, Path]) -> list[str]:
    return ["target=hf", f"target.name={a['target']}", "target.dtype=fp32", "target.local_files_only=true"]


def _data(a: dict[str, Path], ws: Path, path: Path | str | None = None) -> list[str]:
    return ["data=file", f"data.path={path or a['chats']}", "data.max_length=64", f"data.cache_dir={ws / 'cache' / 'data'}"]


def cases(ws: Path, a: dict[str, Path]) -> list[Case]:
    import torch

    T, D = _tgt(a), lambda p=None: _data(a, ws, p)  # noqa: E731
    train = T + D() + ["logging.wandb=disabled", "train.mixed_precision=no", "train.batch_size=8", "train.max_steps=6",
                       "train.log_every=1", "head.num_heads=2", "train.eval_tokens=0", "optim.warmup_steps=0"]

    def resume(name: str, *extra: str) -> list[str]:
        return train + ["train.device=cpu", f"out_dir={ws / f'run-{name}'}", "train.save_every=3", "train.keep_last=5",
                        "train.resume=true", *extra]

    ev = T + ["drafter=medusa", f"checkpoint={ws / 'run' / 'final'}", f"questions={a['questions']}", "max_new_tokens=8",
              f"out={ws / 'eval.json'}"]
    eagle = [x if not x.startswith(("drafter=", "checkpoint=")) else
             {"d": "drafter=eagle", "c": f"checkpoint={ws / 'eagle-head'}"}[x[0]] for x in ev]
    counts = r"read \d+, kept \d+[^;]*"
    out = [
        Case("config", "Unknown config key", "data_prep/prepare.py", T + D() + ["data.bogus=1"], 2),
        Case("config", "Unknown config group option", "data_prep/prepare.py", T + ["data=nope"], 2),
        Case("config", "Required value left unset (`???`)", "scripts/export.py", T, 2),
        Case("config", "`data.path` does not exist", "data_prep/prepare.py", T + D(ws / "nope.json"), 2),
        Case("config", "`data.path` is a directory", "data_prep/prepare.py", T + D(ws / "a_directory"), 2),
        Case("config", "`data=file` without `data.path`", "data_prep/prepare.py", T + ["data=file"], 2),
        Case("config", "`target.name` unknown (offline)", "data_prep/prepare.py",
             ["target.name=no-such-model"] + D(), 2),
        Case("config", "`target.name` is a directory without a model", "data_prep/prepare.py",
             ["target=hf", f"target.name={ws / 'not_a_model'}"] + D(), 2),
        Case("data", "Broken record in a JSON array (the error falls after the newline ending it)",
             "data_prep/prepare.py", T + D(a["broken_end"]) + ["data.heldout_fraction=0.2"], 0, counts),
        Case("data", "`// comment` line inside a JSON array", "data_prep/prepare.py",
             T + D(a["comment"]) + ["data.heldout_fraction=0.2"], 0, counts),
        Case("data", "Broken record in a minified (one-line) JSON array", "data_prep/prepare.py",
             T + D(a["minified"]) + ["data.heldout_fraction=0.2"], 0, counts),
        Case("data", "Non-UTF-8 byte inside one record (`data.on_error=skip`)", "data_prep/prepare.py",
             T + D(a["bad_byte"]) + ["data.heldout_fraction=0.2"], 0, [r"record \d+ .*not valid UTF-8.*", counts]),
        Case("data", "Non-UTF-8 byte inside one record (`data.on_error=raise`)", "data_prep/prepare.py",
             T + D(a["bad_byte"]) + ["data.on_error=raise"], 2),
        Case("data", "Malformed JSON Lines line (`data.on_error=raise`)", "data_prep/prepare.py",
             T + D(a["bad_line"]) + ["data.on_error=raise"], 2),
        Case("data", "Malformed JSON Lines line (`data.on_error=skip`)", "data_prep/prepare.py",
             T + D(a["bad_line"]) + ["data.heldout_fraction=0.2"], 0, counts),
        Case("data", "File cut off inside a record", "data_prep/prepare.py",
             T + D(a["cut"]) + ["data.heldout_fraction=0.2"], 0, r"file is truncated at .*"),
        Case("data", "Empty data file", "data_prep/prepare.py", T + D(a["empty"]), 2),
        Case("data", "No usable conversation in the file", "data_prep/prepare.py", T + D(a["no_usable"]), 2),
        Case("train", "`train.grad_accum=0`", "train/medusa.py", train + ["train.device=cpu", "train.grad_accum=0"], 2),
        Case("train", "`train.batch_size=0`", "train/medusa.py", train + ["train.device=cpu", "train.batch_size=0"], 2),
        Case("train", "`train.max_steps=-1`", "train/medusa.py", train + ["train.device=cpu", "train.max_steps=-1"], 2),
        Case("train", "`train.resume=true`, newest checkpoint lacks `trainer_state/`", "train/medusa.py",
             resume("no_state"), 0, r"resuming from .*"),
        Case("train", "`train.resume=true`, newest checkpoint has a truncated `optimizer.pt`", "train/medusa.py",
             resume("trunc_opt"), 0, r"resuming from .*"),
        Case("train", "`train.resume=true`, no checkpoint complete", "train/medusa.py", resume("none_complete"), 2),
        Case("train", "`train.resume=true` with different data", "train/medusa.py",
             resume("other_data", "data.max_length=48", "train.max_steps=8"), 2),
        Case("train", "`train.resume=true` with a different `head.num_heads`", "train/medusa.py",
             resume("other_heads", "head.num_heads=3", "train.max_steps=8"), 2),
        Case("train", "The same training command rerun into the earlier run's `out_dir` (no `train.resume`)",
             "train/medusa.py", train + ["train.device=cpu", f"out_dir={ws / 'run-rerun'}", "train.save_every=3"], 2),
        Case("eval", "`max_new_tokens=0`", "eval/acceptance.py", ev + ["max_new_tokens=0"], 2),
        Case("eval", "`max_questions=0`", "eval/acceptance.py", ev + ["max_questions=0"], 2),
        Case("eval", "`max_turns=0`", "eval/acceptance.py", ev + ["max_turns=0"], 2),
        Case("eval", "`tree.max_depth=0` (Medusa)", "eval/acceptance.py", ev + ["tree.max_depth=0"], 2),
        Case("eval", "`tree.size=1`", "eval/acceptance.py", ev + ["tree.size=1"], 2),
        Case("eval", "`tree.nodes=0` (EAGLE)", "eval/acceptance.py", eagle + ["tree.nodes=0"], 2),
        Case("eval", "`tree.depth=0` (EAGLE)", "eval/acceptance.py", eagle + ["tree.depth=0"], 2),
        Case("eval", "Prompt longer than the target's context (`max_prompt_tokens=5000`, context 1024)",
             "eval/acceptance.py", T + ["drafter=plain", f"questions={a['long_questions']}", "max_new_tokens=4",
                                        "max_prompt_tokens=5000", f"out={ws / 'eval-long.json'}"], 0,
             r"max_prompt_tokens=5000 is not below.*"),
        Case("eval", "`checkpoint` does not exist", "eval/acceptance.py",
             T + ["drafter=medusa", f"checkpoint={ws / 'nope'}", f"questions={a['questions']}"], 2),
        Case("eval", "Head weights hold NaN", "eval/acceptance.py",
             T + ["drafter=medusa", f"checkpoint={ws / 'nan-head'}", f"questions={a['questions']}"], 2),
        Case("eval", "`questions` file does not exist", "eval/acceptance.py",
             T + ["drafter=plain", f"questions={ws / 'nope.jsonl'}"], 2),
        Case("eval", "`sweep.max_questions=0` (measure)", "eval/measure.py",
             T + [f"questions={a['questions']}", "methods=[plain]", "sweep.max_questions=0", f"out_dir={ws / 'm'}"], 2),
        Case("eval", "`rounds=-1` (exactness)", "eval/exactness.py", ["rounds=-1", "out=null"], 2),
        Case("other", "`max_new_tokens=0` (distill)", "data_prep/distill.py", T + D() + ["max_new_tokens=0"], 2),
        Case("other", "`shard=2/2` (distill)", "data_prep/distill.py", T + D() + ["shard=2/2"], 2),
        Case("other", "`refill=both` (distill)", "data_prep/distill.py", T + D() + ["refill=both"], 2),
        Case("other", "Merge of a sharded distillation with a shard file missing", "data_prep/distill_merge.py",
             [str(ws / "nope.jsonl"), "2"], 2),
        Case("other", "`batch_size=0` (features)", "data_prep/features.py", T + D() + ["batch_size=0"], 2),
        Case("other", "Export of a checkpoint that does not exist", "scripts/export.py",
             T + [f"checkpoint={ws / 'nope'}"], 2),
        Case("other", "Publish of a checkpoint that does not exist", "scripts/publish.py",
             [f"checkpoint={ws / 'nope'}"], 2),
        Case("other", "Sweep report of a directory that does not exist", "scripts/sweep_report.py", [str(ws / "nope")], 2),
        Case("other", "Paired τ with a malformed run spec", "scripts/paired_tau.py", ["a", "b"], 2),
    ]
    run, ck = ws / "run", ws / "run" / "final"
    out += [
        Case("output", "Export into a folder holding the user's own files", "scripts/export.py",
             T + [f"checkpoint={ck}", f"out={ws / 'my-folder'}"], 2),
        Case("output", "Export with `out` = the checkpoint itself", "scripts/export.py", T + [f"checkpoint={ck}", f"out={ck}"],
             2),
        Case("output", "Publish with `out` = the training run's folder", "scripts/publish.py",
             [f"checkpoint={ck}", f"out={run}"], 2),
        Case("output", "Publish over an earlier publish folder without `overwrite=true`", "scripts/publish.py",
             [f"checkpoint={ck}", f"out={ws / 'hub'}", "verify_load=false"], 2),
        Case("output", "Training `out_dir` is an existing file", "train/medusa.py",
             train + ["train.device=cpu", f"out_dir={ws / 'a_file'}"], 2),
        Case("output", "Training `out_dir` where nothing may be written (`/sys`)", "train/medusa.py",
             train + ["train.device=cpu", "out_dir=/sys/draftheads-run"], 2),
        Case("output", "A second job writing into an `out_dir` another live job holds", "train/medusa.py",
             train + ["train.device=cpu", f"out_dir={ws / 'run-held'}"], 2),
        Case("output", "An `out_dir` whose lock a dead job left behind", "train/medusa.py",
             train + ["train.device=cpu", f"out_dir={ws / 'run-stale'}"], 0, r"warning: taking over the lock [^:]*"),
        Case("output", "Distillation `out` is a folder", "data_prep/distill.py", T + D() + [f"out={ws / 'a_directory'}"],
             2),
        Case("output", "Feature capture into a folder holding the user's own files", "data_prep/features.py",
             T + D() + [f"out={ws / 'my-folder'}"], 2),
        Case("config", "`optim.lr=0` (trains nothing)", "train/medusa.py", train + ["train.device=cpu", "optim.lr=0"], 2),
        Case("config", "`optim.lr=-1e-3`", "train/medusa.py", train + ["train.device=cpu", "optim.lr=-1e-3"], 2),
        Case("config", "Another family's head option (`head=eagle3` for Medusa)", "train/medusa.py",
             train + ["train.device=cpu", "head=eagle3"], 2),
        Case("config", "Another family's experiment (`+experiment=medusa_full` for EAGLE-3)", "train/eagle3.py",
             T + D() + ["+experiment=medusa_full"], 2),
        Case("eval", "`tree.top_k=100000` (far beyond one verification forward)", "eval/acceptance.py",
             eagle + ["tree.top_k=100000"], 2),
        Case("eval", "Questions from an empty held-out split (`data.heldout_fraction=0`)", "eval/acceptance.py",
             T + D() + ["drafter=plain", "data.heldout_fraction=0", "max_new_tokens=4", f"out={ws / 'e0.json'}"], 2),
        Case("data", "Records with a role that does not exist (`narrator`)", "data_prep/prepare.py",
             T + D(ws / "roles.json") + ["data.heldout_fraction=0.2"], 0, r"first unknown_role: [^;]*"),
    ]
    if not torch.cuda.is_available():
        out.insert(21, Case("train", "`train.device=cuda` on a host without CUDA", "train/medusa.py",
                            train + ["train.device=cuda"], 2))
    return out


def what_it_says(c: Case, p: subprocess.CompletedProcess) -> str:
    """The line a user reads: the 'error:' line, Hydra's own first line, or the case's warning/summary line."""
    both = p.stdout + "\n" + p.stderr
    if p.returncode != 0:
        err = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
        if err:
            return err[0]
        first = next((ln for ln in p.stderr.splitlines() if ln.strip()), "")
        return f"{first} (Hydra's message, {len(p.stderr.strip().splitlines())} lines, no traceback)" \
            if "Traceback" not in p.stderr else p.stderr.strip().splitlines()[-1]
    found = [m.group(0) for pat in ([c.show] if isinstance(c.show, str) else c.show or [])
             if (m := re.search(pat, both))]
    return " / ".join(found) if found else "(finished)"


def _clean(text: str, ws: Path) -> str:
    text = text.replace(str(ws), "$WS")
    if len(text) > 420:
        text = text[:417] + "..."
    return text.replace("|", "\\|")


def markdown(rows: list[dict], seconds: float) -> str:
    head = """# Reliability: what each kind of bad input gets

Every entry point (`data_prep/prepare.py`, `distill.py`, `features.py`, `train/{medusa,eagle,eagle3}.py`,
`eval/acceptance.py`, `eval/measure.py`, `eval/exactness.py`, `scripts/export.py`, `scripts/publish.py` and the
scripts with their own arguments) ends a **user error** with one line on stderr, `error: <what is wrong: file,
record, field or key, the value, what is allowed>`, and **exit code 2** — no traceback. Hydra's own
config-composition errors (unknown key, unknown option) keep Hydra's short message (no traceback) and also exit 2.
An **internal bug** (any other exception) still prints its traceback (exit 1). `HYDRA_FULL_ERROR=1` or
`DRAFTHEADS_DEBUG=1` shows the traceback of a user error too. The mechanism is `heads/job.py`.

Inputs that are usable in part (a data file with a broken record, a checkpoint directory whose newest checkpoint
is incomplete, a prompt past the target's context) run to the end and say what they skipped, counted, on a
WARNING/INFO line; nothing is dropped without a count.

The table is produced by running every case: `PYTHONPATH=. python scripts/reliability_table.py` (tiny random
target and small files built by the script, offline; `$WS` is its temporary workspace).

| Area | Bad input | Entry | Exit | What the user sees |
|---|---|---|---|---|
"""
    body = "".join(f"| {r['group']} | {r['kind']} | `{r['entry']}` | {r['exit']} | {r['says']} |\n" for r in rows)
    return head + body + f"\n{len(rows)} cases, {sum(r['exit'] == 2 for r in rows)} stop with exit 2, " \
        f"{sum(r['exit'] == 0 for r in rows)} finish with a counted warning; run in {seconds:.0f} s.\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "reliability.md"), help="markdown file to write")
    ap.add_argument("--only", default=None, help="run only the cases whose description contains this")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, bad = [], []
    with tempfile.TemporaryDirectory(prefix="draftheads-reliability-") as tmp:
        ws = Path(tmp)
        assets = _write_assets(ws)
        _train_run(ws, assets)
        todo = [c for c in cases(ws, assets) if a.only is None or a.only in c.kind]
        for i, c in enumerate(todo, 1):
            p = _run(ws, c.entry, c.args)
            says = what_it_says(c, p)
            ok = p.returncode == c.expect and "Traceback" not in p.stderr
            print(f"[{i}/{len(todo)}] {'ok ' if ok else 'BAD'} exit {p.returncode}: {c.kind}: {_clean(says, ws)}",
                  flush=True)
            if not ok:
                bad.append(f"{c.kind}: exit {p.returncode} (expected {c.expect})\n{p.stderr[-2500:]}")
            rows.append({"group": c.group, "kind": c.kind, "entry": c.entry, "exit": p.returncode,
                         "says": _clean(says, ws)})
    text = markdown(rows, time.perf_counter() - t0)
    if a.only is None:
        from draftheads.heads.checkpoint import atomic_write_text

        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(a.out), text)
        print(f"wrote {a.out}")
    for b in bad:
        print(f"\nUNEXPECTED: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(main)
