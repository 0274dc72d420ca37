"""Run every launch config in conf/launch/ on a tiny random target and tabulate what ran:
steps/s, peak memory per process, and the distributed mode each process actually used.

    python scripts/bench_launch.py [--family medusa] [--steps 20] [--processes 2] [--out runs/bench/launch]

Writes ``<out>.json`` and ``<out>.md``. Each config is started exactly as a user would
(``accelerate launch --config_file conf/launch/<x>.yaml ... train/<family>.py``) with ``train.device``
set from ``--device`` (cpu here: DDP over gloo, the real DeepSpeed engine on its CPU accelerator,
FSDP2 over gloo). The trainer records what ran in ``run_info.json`` (mode, ZeRO stage, per-rank peak
RSS), which is what the table reports. Numbers depend on the machine and its load; rerun before relying
on one. The multi-node config runs as two emulated nodes on this machine (two launchers, machine ranks
0 and 1, rendezvous on 127.0.0.1) — the per-node command scripts/slurm_train.sbatch issues.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["single", "ddp", "zero2", "zero3", "fsdp", "multinode"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_assets(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama target + a synthetic chat file (the test suite's fixtures)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import CHATML, make_tokenizer, synthetic_conversations, tiny_model

    tgt = root / "tiny-llama"
    tiny_model("llama").save_pretrained(tgt)
    make_tokenizer(CHATML).save_pretrained(tgt)
    chats = root / "chats.jsonl"
    chats.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(240)) + "\n")
    return tgt, chats


def overrides(target: Path, chats: Path, out: Path, steps: int, batch: int, device: str, cache: Path) -> list[str]:
    return ["target=hf", f"target.name={target}", "target.dtype=fp32", "target.local_files_only=true", "data=file",
            f"data.path={chats}", "data.max_length=64", "data.heldout_fraction=0.1", f"data.cache_dir={cache}",
            f"out_dir={out}", f"hydra.run.dir={out}", "logging.wandb=disabled", f"train.device={device}",
            "train.mixed_precision=no", f"train.batch_size={batch}", f"train.max_steps={steps}",
            "train.log_every=1", "train.save_every=0", "train.eval_tokens=0", "train.sim_tau_examples=0",
            "optim.warmup_steps=0"]


def run_one(name: str, family: str, target: Path, chats: Path, root: Path, steps: int, procs: int,
            device: str, global_batch: int) -> dict:
    n = 1 if name == "single" else procs
    out = root / f"run-{name}"
    port = free_port()
    launch = ["accelerate", "launch", "--config_file", str(REPO / "conf" / "launch" / f"{name}.yaml"),
              "--num_processes", str(n), "--main_process_port", str(port)]
    script = [str(REPO / "train" / f"{family}.py"),
              *overrides(target, chats, out, steps, global_batch // n, device, root / "data-cache")]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_MODE="disabled",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    if name == "multinode":
        # Two "nodes" on this machine: one launcher per node rank, exactly the per-node command of
        # scripts/slurm_train.sbatch, rendezvous over 127.0.0.1 (n processes in total).
        if n % 2:
            raise ValueError("the multinode emulation needs an even --processes")
        nodes = [subprocess.Popen(launch + ["--num_machines", "2", "--machine_rank", str(r), "--main_process_ip",
                                            "127.0.0.1"] + script, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [q.communicate() for q in nodes]
        p = subprocess.CompletedProcess(nodes[0].args, max(q.returncode for q in nodes), outs[0][0],
                                        outs[0][1] + outs[1][1])
    else:
        p = subprocess.run(launch + script, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    info_f = out / "run_info.json"
    if p.returncode != 0 or not info_f.is_file():
        return {"config": name, "ran": False, "processes": n, "wall_s": round(wall, 1),
                "note": "failed: " + (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    info = json.loads(info_f.read_text())
    summ = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    launch = info["launch"]
    return {"config": name + (" (2 nodes emulated on localhost)" if name == "multinode" else ""), "ran": True,
            "processes": n, "mode": launch["mode"],
            "distributed_type": launch["distributed_type"], "zero_stage": launch["zero_stage"],
            "target_sharding": (launch.get("target_sharding") or {}).get("kind"),
            "steps": info["steps"], "steps_per_s": info["steps_per_s"], "tokens_per_s": info["tokens_per_s"],
            "peak_rss_mb_per_process": info["peak_rss_mb_per_rank"],
            "final_loss": (summ.get("losses") or [None])[-1], "wall_s": round(wall, 1)}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Launch configs on {meta['device']} ({meta['family']}, tiny random Llama, global batch "
             f"{meta['global_batch']}, {meta['steps']} steps, {meta['processes']} processes where multi-process)", "",
             "| config | ran here | processes | mode (distributed type, ZeRO) | target sharded | steps/s | "
             "peak RSS per process (MB) | final loss | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ran"]:
            mode = f"{r['mode']} ({r['distributed_type']}" + (f", ZeRO-{r['zero_stage']}" if r["zero_stage"] else "") + ")"
            lines.append(f"| {r['config']} | yes | {r['processes']} | {mode} | {r['target_sharding'] or 'no'} | "
                         f"{r['steps_per_s']:.2f} | {', '.join(f'{x:.0f}' for x in r['peak_rss_mb_per_process'])} | "
                         f"{r['final_loss']:.5f} | |")
        else:
            lines.append(f"| {r['config']} | no | {r.get('processes', '—')} | — | — | — | — | — | {r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="medusa", choices=["medusa", "eagle", "eagle3"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="runs/bench/launch")
    a = ap.parse_args(argv)
    if a.global_batch % a.processes:
        raise ValueError("--global-batch must be divisible by --processes")
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as d:
        root = Path(d)
        target, chats = tiny_assets(root)
        rows = []
        for name in a.configs.split(","):
            r = run_one(name, a.family, target, chats, root, a.steps, a.processes, a.device, a.global_batch)
            print(json.dumps(r), flush=True)
            rows.append(r)
    meta = {"family": a.family, "steps": a.steps, "processes": a.processes, "global_batch": a.global_batch,
            "device": a.device, "cpus": os.cpu_count(), "torch_threads_per_process": os.environ.get("OMP_NUM_THREADS", "1")}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = markdown(rows, meta)
    out.with_suffix(".md").write_text(md)
    print(md)
    return rows


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(main)
