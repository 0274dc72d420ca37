"""Training memory per family and target, with the resident weights and optimizer state broken out, and JSON.

    python scripts/bench_memory.py [--families medusa eagle eagle3 block] [--targets smollm2-135m random:gemma3-262k]
        [--lengths 768 2048 8192] [--steps 3] [--quickstart-steps 5] [--out runs/bench/memory.json]
        [--set block:head.draft_vocab_size=32768 ...]

Why: a loss that holds fp32 logits [tokens, V] for every head or TTT step grows with the vocabulary; the families
compute theirs in row chunks (train/losses.py). This measures what a training job holds: per cell (family ×
target × sequence length, batch 1) a few optimizer steps of the real entry (``train/<family>.py``'s ``main``)
on synthetic rows of exactly that length (assistant tokens after a 16-token prompt), in a fresh process each
(peak RSS is per process). Recorded: the training loop's peak (RSS on CPU, ``max_memory_allocated`` on CUDA), the
resident weights (target + draft), the optimizer state, the peak net of those two, and that net less the
``runtime``: what was resident when the loop began besides the weights (on CPU the interpreter, libraries and
data, ~0.4-0.6 GB; on CUDA ~0), i.e. what the training steps themselves add beyond the optimizer state. ``ratios`` compares each family's net
peak on the largest-vocabulary target with the smallest at the same length, per family and ``--set`` variant.

Targets: any ``target.name`` the entries load (``smollm2-135m``, a local directory, later ``gemma3-270m``), or
``random:gemma3-262k``: Gemma-3-270M's shape (vocabulary 262,144, hidden 640, 18 layers, sliding window 512 on
five of six layers, tied embeddings) with random weights, built from its config; it stands in for the real
target's memory, not its predictions. ``--quickstart-steps N`` also runs the quickstart's own Medusa training
(``scripts/quickstart.sh``'s overrides, N steps) and records its peak RSS.

A cell whose RSS passes ``--max-rss-gb`` (default: 80% of the memory available at start) is stopped and
recorded as ``stopped``, as is one running past ``--timeout``; nothing is extrapolated.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.registry import FAMILIES as REGISTERED

REPO = Path(__file__).resolve().parents[1]
# every registered family with a training entry (train/<family>.py), in registry order
FAMILIES = tuple(f for f in REGISTERED if (REPO / "train" / f"{f}.py").is_file())
PROMPT_TOKENS = 16  # leading non-assistant tokens of every synthetic row
TOKEN_IDS = 49152  # synthetic rows draw ids below this (inside every target's vocabulary)
# Gemma-3-270M's text config (google/gemma-3-270m), random weights: the 262k-vocabulary stand-in
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                   rope_theta=1_000_000.0, query_pre_attn_scalar=256, tie_word_embeddings=True,
                   max_position_embeddings=32768, pad_token_id=0, eos_token_id=1, bos_token_id=2)
# tiny ones (tests): the two vocabularies on the same small body
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, sliding_window=64, tie_word_embeddings=True, max_position_embeddings=4096, pad_token_id=0)
RANDOM_TARGETS = {"random:gemma3-262k": ("gemma3_text", GEMMA3_270M),
                  "random:tiny-49k": ("gemma3_text", {**TINY, "vocab_size": 49152}),
                  "random:tiny-262k": ("gemma3_text", {**TINY, "vocab_size": 262144})}
# scripts/quickstart.sh's Medusa training (its STEPS default is 100)
QUICKSTART = ["data=sharegpt_small", "data.max_length=256", "train.batch_size=4", "head.share_lm_head=true",
              "optim.lr=2e-3", "train.save_every=50", "train.overwrite=true"]
# per family: what the cells change from conf/<family>.yaml (Medusa as the quickstart trains it); others: nothing
FAMILY_OVERRIDES = {"medusa": ["head.share_lm_head=true"]}


def family_overrides(family: str, extra: list[str] | None = None) -> list[str]:
    return [*FAMILY_OVERRIDES.get(family, []), *(extra or [])]


# ------------------------------------------------------------------------------------------
# One cell, in its own process
# ------------------------------------------------------------------------------------------

def rss_mb(pid: int | str = "self") -> float:
    """Current resident set size (MB) of a process, 0 when it is gone."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def build_target(name: str, device: str):
    """A random-weight target from ``RANDOM_TARGETS``, or None (the entry loads ``name`` itself)."""
    if name not in RANDOM_TARGETS:
        return None
    import torch
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from draftheads.heads.target import from_model

    kind, kw = RANDOM_TARGETS[name]
    cfg = AutoConfig.for_model(kind, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    # the entries read only pad_token_id from the tokenizer when the data is given (synthetic rows, below)
    return from_model(model, SimpleNamespace(pad_token_id=0), name=name)


def synthetic_data(length: int, rows: int, seed: int = 0):
    """PreparedData of ``rows`` rows of exactly ``length`` tokens, assistant tokens after PROMPT_TOKENS."""
    import numpy as np
    from datasets import Dataset

    from draftheads.data_prep.dataset import PreparedData

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, TOKEN_IDS, size=(rows, length)).tolist()
    mask = [[0] * PROMPT_TOKENS + [1] * (length - PROMPT_TOKENS)] * rows
    train = Dataset.from_dict({"input_ids": ids, "loss_mask": mask})
    heldout = Dataset.from_dict({"input_ids": [], "loss_mask": []})
    return PreparedData(train=train, heldout=heldout, heldout_questions=Path(os.devnull), stats={})


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps of one family in this process; measure memory around the real entry."""
    import importlib
    import resource

    import torch
    from hydra import compose, initialize_config_dir

    from draftheads.train.distributed import resolve_mixed_precision

    family, device = spec["family"], spec["device"]
    entry = importlib.import_module(f"draftheads.train.{family}")
    cuda = device == "cuda"
    target = build_target(spec["target"], device)
    overrides = [f"out_dir={spec['out_dir']}", "logging.wandb=disabled", f"train.max_steps={spec['steps']}",
                 f"train.device={device}", "train.log_every=1"]
    if spec.get("quickstart"):  # the whole job, its held-out evaluation and simulated τ at the end included
        overrides = [*QUICKSTART, *overrides]
    else:  # the training steps only: no held-out split, no checkpoint before the final one
        overrides += [f"target.name={spec['target']}", "train.batch_size=1", "train.eval_tokens=0",
                      "train.sim_tau_examples=0", "train.save_every=0", *family_overrides(family, spec.get("set"))]
        data = synthetic_data(spec["length"], spec["steps"])
        entry.prepare_data = lambda cfg, tokenizer: data
    if target is not None:
        overrides = [o for o in overrides if not o.startswith("target.name=")]
        entry.load_target = lambda cfg, device=None: target
    trainers: list[Any] = []
    at_fit: list[float] = []

    class Measured(entry.Trainer):  # type: ignore[name-defined]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            trainers.append(self)

        def fit(self, *a: Any, **kw: Any):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                at_fit.append(torch.cuda.memory_allocated() / 2 ** 20)
            else:
                at_fit.append(rss_mb())
            return super().fit(*a, **kw)

    entry.Trainer = Measured
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(family, overrides)
    t0 = time.perf_counter()
    summary = entry.main(cfg)
    seconds = time.perf_counter() - t0
    tr = trainers[0]
    objective = tr._unwrapped()
    tgt = objective.target
    weights_target = storage_bytes([*tgt.model.parameters(), *tgt.model.buffers()])
    weights_draft = storage_bytes([*objective.parameters(), *objective.buffers()])
    opt = [v for st in tr._opt().state.values() for v in st.values() if torch.is_tensor(v)]
    mb = 1 / 2 ** 20
    out = {"steps": int(summary["steps"]), "seconds": round(seconds, 1),
           "seconds_per_step": round(float(summary["seconds"]) / max(1, int(summary["steps"])), 1),
           "vocab_size": int(tgt.vocab_size), "hidden_size": int(tgt.hidden_size), "target_dtype": str(tgt.dtype),
           "mixed_precision": resolve_mixed_precision(str(cfg.train.mixed_precision), device),
           "weights_target_mb": round(weights_target * mb, 1), "weights_draft_mb": round(weights_draft * mb, 1),
           "trainable_params": int(tr.trainable_params), "optimizer_state_mb": round(storage_bytes(opt) * mb, 1),
           "grads_mb_at_most": round(sum(p.numel() * p.element_size() for p in objective.parameters()
                                         if p.requires_grad) * mb, 1)}
    if cuda:
        out["peak_mb"] = round(torch.cuda.max_memory_allocated() * mb, 1)
        out["memory"] = "cuda max_memory_allocated during fit()"
    else:
        out["peak_mb"] = float(summary["peak_rss_loop_mb_per_rank"][0])
        out["process_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        out["memory"] = "peak RSS during fit() (VmHWM reset at its start)"
    out["weights_mb"] = round(out["weights_target_mb"] + out["weights_draft_mb"], 1)
    out["net_mb"] = round(out["peak_mb"] - out["weights_mb"] - out["optimizer_state_mb"], 1)
    # what was resident when the loop began besides the weights: interpreter, libraries, data (CPU); 0-ish on CUDA
    out["at_fit_start_mb"] = round(at_fit[0], 1)
    out["runtime_mb"] = round(at_fit[0] - out["weights_mb"], 1)
    out["net_less_runtime_mb"] = round(out["net_mb"] - out["runtime_mb"], 1)  # what the loop adds beyond its optimizer
    return out


# ------------------------------------------------------------------------------------------
# The driver: one child process per cell, watched
# ------------------------------------------------------------------------------------------

def available_gb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


def launch(spec: dict[str, Any], max_rss_gb: float, timeout: float) -> dict[str, Any]:
    """Run one cell in a child process; stop it above ``max_rss_gb`` RSS or after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as d:
        spec = {**spec, "out_dir": str(Path(d) / "run")}
        env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        p = subprocess.Popen([sys.executable, __file__, "--cell", json.dumps(spec)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0, seen, why = time.time(), 0.0, None
        out_lines: list[str] = []
        reader = threading.Thread(target=lambda: out_lines.extend(p.stdout), daemon=True)  # type: ignore[arg-type]
        err: list[str] = []
        err_reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        err_reader.start()
        while p.poll() is None:
            seen = max(seen, rss_mb(p.pid))
            if seen > max_rss_gb * 1024:
                why = f"RSS passed {max_rss_gb:.1f} GB (--max-rss-gb) at {time.time() - t0:.0f} s"
            elif time.time() - t0 > timeout:
                why = f"still running after {timeout:.0f} s (--timeout)"
            if why:
                p.kill()
                p.wait()
                break
            time.sleep(0.2)
        reader.join(5)
        err_reader.join(5)
    line = next((l for l in out_lines if l.startswith("CELL ")), None)
    if why or line is None:
        return {"status": "stopped" if why else "failed", "why": why or "".join(err)[-1500:],
                "rss_seen_mb": round(seen, 1), "seconds": round(time.time() - t0, 1)}
    return {"status": "ok", **json.loads(line[5:])}


def ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family, ``--set`` variant and length: net peak on the largest-vocabulary target / on the smallest."""
    out = []
    ok = [c for c in cells if c.get("status") == "ok" and not c.get("quickstart")]
    variants = list(dict.fromkeys((c["family"], tuple(c.get("set") or ())) for c in ok))
    for fam, extra in variants:
        mine = [c for c in ok if c["family"] == fam and tuple(c.get("set") or ()) == extra]
        for length in sorted({c["length"] for c in mine}):
            row = sorted((c for c in mine if c["length"] == length), key=lambda c: c["vocab_size"])
            if len(row) < 2 or row[0]["vocab_size"] == row[-1]["vocab_size"]:
                continue
            small, large = row[0], row[-1]
            r = {"family": fam, "length": length, "small": small["target"], "large": large["target"],
                 "net_ratio": round(large["net_mb"] / small["net_mb"], 3)}
            if extra:
                r["set"] = list(extra)
            r["net_less_runtime_ratio"] = round(large["net_less_runtime_mb"] / small["net_less_runtime_mb"], 3)
            out.append(r)
    return out


def table(cells: list[dict[str, Any]]) -> str:
    head = ("target", "family", "T", "status", "peak MB", "weights", "optimizer", "net", "net-runtime", "s/step")
    rows = [head]
    for c in cells:
        name = "quickstart medusa" if c.get("quickstart") else " ".join([c["family"], *(c.get("set") or [])])
        length = f"{c['steps']} steps" if c.get("quickstart") else str(c["length"])
        if c["status"] != "ok":
            rows.append((c["target"], name, length, c["status"], f">{c.get('rss_seen_mb', 0):.0f}", "", "", "", "", ""))
            continue
        rows.append((c["target"], name, length, "ok", f"{c['peak_mb']:.0f}", f"{c['weights_mb']:.0f}",
                     f"{c['optimizer_state_mb']:.0f}", f"{c['net_mb']:.0f}", f"{c['net_less_runtime_mb']:.0f}",
                     f"{c['seconds_per_step']:.1f}"))
    w = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return "\n".join(" | ".join(str(x).ljust(w[i]) for i, x in enumerate(r)) for r in rows)


def host() -> dict[str, Any]:
    import torch

    from draftheads.scripts.bench_distill import cpu_facts  # model name, cores, bf16 natively or not, flags

    return {"cpu": cpu_facts(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "loadavg_start": os.getloadavg()[0], "memory_available_gb_start": round(available_gb(), 1),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--targets", nargs="+", default=["smollm2-135m", "random:gemma3-262k"])
    ap.add_argument("--lengths", nargs="*", type=int, default=[768, 2048, 8192], help="none: only the quickstart")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per cell (batch 1)")
    ap.add_argument("--quickstart-steps", type=int, default=0, help="also the quickstart's Medusa training, N steps")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--max-rss-gb", type=float, default=None, help="stop a cell above this RSS (default: 80%% of "
                    "the memory available at start)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per cell")
    ap.add_argument("--out", default="runs/bench/memory.json")
    ap.add_argument("--set", nargs="+", default=[], metavar="FAMILY:KEY=VALUE",
                    help="an extra override for one family's cells, e.g. block:head.draft_vocab_size=32768")
    a = ap.parse_args()
    if a.cell:
        print("CELL " + json.dumps(run_cell(json.loads(a.cell))), flush=True)
        return
    extra: dict[str, list[str]] = {}
    for item in a.set:
        fam, _, override = item.partition(":")
        if fam not in FAMILIES or "=" not in override:
            ap.error(f"--set {item!r}: expected FAMILY:KEY=VALUE with FAMILY one of {', '.join(FAMILIES)}")
        extra.setdefault(fam, []).append(override)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    max_rss = a.max_rss_gb if a.max_rss_gb is not None else 0.8 * available_gb()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join(["python", "scripts/bench_memory.py", *sys.argv[1:]]), "host": host(), "device": device,
        "batch_size": 1, "steps": a.steps, "prompt_tokens": PROMPT_TOKENS, "max_rss_gb": round(max_rss, 1),
        "families": {f: family_overrides(f, extra.get(f)) for f in a.families}, "cells": []}
    specs = []
    if a.quickstart_steps:
        specs.append({"family": "medusa", "target": "smollm2-135m", "quickstart": True, "steps": a.quickstart_steps,
                      "length": None})
    specs += [{"family": f, "target": t, "length": n, "steps": a.steps, **({"set": extra[f]} if f in extra else {})}
              for t in a.targets for n in sorted(a.lengths) for f in a.families]
    for spec in specs:
        print(f"cell {spec['target']} {spec['family']} {'quickstart' if spec.get('quickstart') else spec['length']} ...",
              flush=True)
        r = {**spec, **launch({**spec, "device": device}, max_rss, a.timeout)}
        result["cells"].append(r)
        result["ratios"] = ratios(result["cells"])
        atomic_write_text(out, json.dumps(result, indent=2) + "\n")  # after every cell: a stopped run keeps what it measured
        print(f"  {r['status']}: " + (f"peak {r['peak_mb']:.0f} MB, net {r['net_mb']:.0f} MB" if r["status"] == "ok"
                                      else r["why"][-300:]), flush=True)
    print(table(result["cells"]))
    for r in result.get("ratios", []):
        print(f"{r['family']} T={r['length']}: net {r['large']} / {r['small']} = {r['net_ratio']}"
              + f" (less runtime: {r['net_less_runtime_ratio']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
