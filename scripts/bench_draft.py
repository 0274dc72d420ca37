"""Benchmark what drafting costs per verification step, per head family and tree size. Writes JSON.

    python scripts/bench_draft.py [--dtype auto] [--threads 1] [--context 300] [--steps 24] [--repeats 3]
        [--configs medusa:16,eagle3:dynamic:16,...] [--medusa DIR] [--eagle DIR] [--eagle3 DIR]
        [--out runs/bench/draft.json]

Why: a draft head pays only if drafting plus verification cost less than the tokens they save; on a
CPU a one-token forward of the 135M target (t_1) is ~35-50 ms, so a drafter that spends half of that
per step eats most of what it accepts. This decodes a real chat-templated ShareGPT prompt with the
loop's own ``eval.generate.generate`` and reports, per verification step, the drafter's time
(``propose`` + ``accept``), the verification forward and the bookkeeping outside both (masks, the
verification rule, cache compaction), each as a fraction of t_1 measured by plain decoding of the
same prompt in the same round. Configurations run round-robin for ``--repeats`` rounds (medians), so
load drift on a shared machine hits them alike.

Heads are randomly initialised with the real shapes (Medusa: K=4 heads with their own [V, H] lm_heads,
plus the shared-lm_head variant; EAGLE: fc + one target layer over the full vocabulary; EAGLE-3: three
aux layers, 32k draft vocabulary) unless a checkpoint is given: what a draft costs does not depend on
its training, only how many tokens each step accepts (and so how many pairs the next step commits).
Config syntax: ``medusa:SIZE`` / ``medusa-shared:SIZE`` (static tree of SIZE nodes, root included),
``eagle:dynamic:SIZE[:TOP_K[:DEPTH]]`` / ``eagle3:...`` (EAGLE-2 tree of SIZE-1 drafted nodes, default
top_k 10 and depth 6, top_k capped at SIZE-1), ``eagle:chain:DEPTH`` / ``eagle3:chain:DEPTH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]

from draftheads.eval.eagle3_drafter import Eagle3Drafter  # noqa: E402
from draftheads.eval.eagle_drafter import EagleDrafter, EagleTreeConfig  # noqa: E402
from draftheads.eval.drafters import MedusaDrafter, ranked_static_tree  # noqa: E402
from draftheads.eval.generate import NoDrafter, generate  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.eagle import EagleDraft, eagle_config_for  # noqa: E402
from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for  # noqa: E402
from draftheads.heads.medusa import MedusaHeads, medusa_config_for  # noqa: E402
from draftheads.heads.target import FrozenTarget, TargetConfig, dtype_name, load_target, parse_dtype, resolve_device  # noqa: E402

DEFAULT_CONFIGS = ("medusa:16,medusa:64,medusa-shared:16,medusa-shared:64,"
                   "eagle:dynamic:16,eagle:dynamic:32,eagle:dynamic:61,eagle:chain:6,"
                   "eagle3:dynamic:16,eagle3:dynamic:32,eagle3:dynamic:61,eagle3:chain:6")
FAMILIES = ("medusa", "medusa-shared", "eagle", "eagle3")


def parse_config(spec: str) -> dict[str, Any]:
    """'eagle3:dynamic:16:8:5' -> {family, kind, size, top_k, depth}; ValueError naming the bad part."""
    parts = spec.strip().split(":")
    fam = parts[0]
    if fam not in FAMILIES:
        raise ValueError(f"--configs entry {spec!r}: family {fam!r} is not one of {', '.join(FAMILIES)}")
    try:
        if fam.startswith("medusa"):
            if len(parts) != 2:
                raise ValueError
            return {"family": fam, "kind": "static", "size": int(parts[1])}
        kind = parts[1]
        if kind == "chain" and len(parts) == 3:
            return {"family": fam, "kind": "chain", "depth": int(parts[2]), "size": int(parts[2]) + 1}
        if kind == "dynamic" and 3 <= len(parts) <= 5:
            size = int(parts[2])
            top_k = min(int(parts[3]) if len(parts) > 3 else 10, size - 1)
            depth = int(parts[4]) if len(parts) > 4 else 6
            return {"family": fam, "kind": "dynamic", "size": size, "top_k": top_k, "depth": depth}
    except ValueError:
        pass
    raise ValueError(f"--configs entry {spec!r}: expected medusa:SIZE, medusa-shared:SIZE, "
                     f"{fam}:dynamic:SIZE[:TOP_K[:DEPTH]] or {fam}:chain:DEPTH")


def make_drafter(c: dict[str, Any], target: FrozenTarget, dtype: torch.dtype, ckpt: dict[str, str | None],
                 seed: int = 0, screen: bool | None = None) -> Any:
    """A drafter of the config's family: from a checkpoint if one was given, else random heads of real shapes."""
    torch.manual_seed(seed)
    fam, dev = c["family"], target.device
    kw = {} if screen is None else {"screen": screen}  # (drafters before the screen option take no such argument)
    if fam.startswith("medusa"):
        if ckpt.get("medusa") and fam == "medusa":
            heads = MedusaHeads.from_pretrained(ckpt["medusa"], target)
        else:
            heads = MedusaHeads(medusa_config_for(target, 4, 1, fam == "medusa-shared"), target.lm_head())
            for b in heads.blocks.parameters():  # identity init is all zeros; random blocks cost the same
                b.data.normal_(0, 0.02)
        tree, _ = ranked_static_tree(OmegaConf.create({"size": c["size"]}), heads.config.num_heads, None)
        return MedusaDrafter(heads.to(dev), tree, dtype, **kw)
    tc = EagleTreeConfig(kind=c["kind"], top_k=c.get("top_k", 10), depth=c.get("depth", 6), nodes=c["size"] - 1)
    if fam == "eagle":
        draft = (EagleDraft.from_pretrained(ckpt["eagle"], target) if ckpt.get("eagle")
                 else EagleDraft(eagle_config_for(target), target))
        return EagleDrafter(draft.to(dev), tc, dtype, **kw)
    if ckpt.get("eagle3"):
        draft = Eagle3Draft.from_pretrained(ckpt["eagle3"], target)
    else:
        draft = Eagle3Draft(eagle3_config_for(target, None, None), target)
        V, DV = target.vocab_size, draft.config.draft_vocab_size
        draft.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:DV])
    return Eagle3Drafter(draft.to(dev), tc, dtype, **kw)


def bench_prompt(target: FrozenTarget, context: int) -> list[int]:
    """The first embedded ShareGPT first turn, chat-templated, whose prompt reaches ``context`` tokens (cut there)."""
    from draftheads.data_prep.sources import load_conversations
    from draftheads.data_prep.template import ensure_chat_template, prompt_ids

    ensure_chat_template(target.tokenizer, None)
    convs, _ = load_conversations("sharegpt", None, 2000)
    for conv in convs:
        user = next((m["content"] for m in conv.messages if m["role"] == "user"), None)
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": user}]) if user else []
        if len(ids) >= context:
            return ids[:context]
    raise ValueError(f"--context {context}: no ShareGPT first turn among 2000 conversations is that long")


def per_step(res: Any) -> dict[str, float]:
    """Milliseconds per verification step of one generate() run."""
    n = max(1, res.steps)
    return {"draft_ms": 1000 * res.draft_seconds / n, "verify_ms": 1000 * res.target_seconds / n,
            "book_ms": 1000 * res.bookkeeping_seconds / n, "tau": res.tau}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":  # this thread's CPU time: on an oversubscribed host wall time counts other jobs' turns
        import draftheads.eval.generate as gen

        gen._clock = lambda dev: time.thread_time()
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    configs = [parse_config(s) for s in args.configs.split(",") if s.strip()]
    ckpt = {"medusa": args.medusa, "eagle": args.eagle, "eagle3": args.eagle3}
    target = load_target(TargetConfig(dtype=dtype_name(dtype)), device)
    prompt = bench_prompt(target, args.context)
    screen = {"auto": None, "on": True, "off": False}[args.screen]
    drafters = [make_drafter(c, target, dtype, ckpt, screen=screen) for c in configs]
    n_new = args.steps + 1
    plain: list[dict[str, float]] = []
    runs: list[list[dict[str, float]]] = [[] for _ in configs]
    load_before = list(os.getloadavg())
    for r in range(args.repeats + 1):  # round 0 is an untimed warm-up
        res = generate(target, NoDrafter(), prompt, n_new)
        if r:
            plain.append(per_step(res))
        for i, d in enumerate(drafters):
            res = generate(target, d, prompt, n_new)
            if r:
                runs[i].append(per_step(res))
        print(f"round {r}/{args.repeats} done", flush=True)
    t1 = statistics.median(p["verify_ms"] for p in plain)
    plain_book = statistics.median(p["book_ms"] for p in plain)
    rows = []
    for c, rs in zip(configs, runs):
        med = {k: statistics.median(x[k] for x in rs) for k in ("draft_ms", "verify_ms", "book_ms", "tau")}
        rows.append({**c, "draft_ms": round(med["draft_ms"], 3), "draft_pct_of_t1": round(100 * med["draft_ms"] / t1, 1),
                     "verify_ms": round(med["verify_ms"], 3), "verify_ratio_to_t1": round(med["verify_ms"] / t1, 3),
                     "book_ms": round(med["book_ms"], 3), "book_pct_of_t1": round(100 * med["book_ms"] / t1, 1),
                     "tau": round(med["tau"], 3),
                     "draft_pct_runs": [round(100 * x["draft_ms"] / t1, 1) for x in rs]})
        print(f"{c['family']:>13} {c['kind']:>7} size {c['size']:>3}: draft {rows[-1]['draft_pct_of_t1']:5.1f}% of t_1, "
              f"verify {rows[-1]['verify_ratio_to_t1']:.2f}x, bookkeeping {rows[-1]['book_pct_of_t1']:.1f}%", flush=True)
    result = {
        "device": str(device), "dtype": dtype_name(dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": getattr(torch.cpu, "get_capabilities", lambda: {})().get("cpu_name") if device.type == "cpu" else None,
        "clock": args.clock, "screen": args.screen, "context": len(prompt), "steps": args.steps, "repeats": args.repeats,
        "checkpoints": {k: v for k, v in ckpt.items() if v},
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "t1_ms": round(t1, 3), "plain_book_ms": round(plain_book, 3), "plain_book_pct_of_t1": round(100 * plain_book / t1, 1),
        "t1_runs_ms": [round(p["verify_ms"], 3) for p in plain], "configs": rows,
        "note": "draft = propose + accept per verification step; fractions are of t_1 = plain decoding's one-token "
                "forward on the same prompt in the same rounds (medians over rounds)",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"t_1 {t1:.2f} ms; wrote {out}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens under the drafted steps")
    ap.add_argument("--steps", type=int, default=24, help="verification steps per run (random heads accept ~0)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (plus one warm-up)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--medusa", default=None, help="Medusa checkpoint dir (replaces the random 'medusa' heads)")
    ap.add_argument("--eagle", default=None, help="EAGLE checkpoint dir")
    ap.add_argument("--eagle3", default=None, help="EAGLE-3 checkpoint dir")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (stable on a shared, oversubscribed host); wall: perf_counter")
    ap.add_argument("--screen", choices=("auto", "on", "off"), default="auto",
                    help="int8-screened draft top-k (eval.draft_logits): auto = bf16/fp16 on a CPU")
    ap.add_argument("--out", default="runs/bench/draft.json")
    args = ap.parse_args(argv)
    if min(args.steps, args.repeats, args.context, args.threads) < 1:
        raise ValueError("--steps, --repeats, --context and --threads must be >= 1")
    return run(args)


if __name__ == "__main__":
    main()
