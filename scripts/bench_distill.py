"""Benchmark the self-distillation job's generation: new tokens/s of its engines on the same prompts. Writes JSON.

    python scripts/bench_distill.py [--engines slots,slots-separate,hf] [--prompts 64] [--new 128] [--batch 64]
                                    [--hf-batch 16] [--dtype auto] [--turns first] [--out runs/bench/distill.json]

Why: the distill job's speed decides how much training data a CPU can make (issue 22 asks >= 1,000 new tokens/s
for SmolLM2-135M on a 2-core CPU). This runs the job's own engines (``data_prep.distill_engines.run_slots`` and
``run_hf``; ``slots-separate`` is the slot engine with ``refill=separate``) one after the other in one process
on the first ``--prompts`` conversations of ShareGPT's training
split (the job's own prompt selection: eval prompts excluded, greedy duplicates skipped, sorted by length), so the
ratio between them is measured in one time window. ``tokens_per_s_all_rows_busy`` is the slot engine's rate
until its queue ran dry (every row working): what a job over thousands of conversations runs at; the overall
figure also holds the tail, where rows retire one by one and the longest prompts of the sort run last. Shared machines are noisy: the JSON records the load average
before and after each engine, the threads, the dtype and the host's CPU flags next to every figure, and the slot
engine's split of its time (prefill, decode forward, sampling). ``--profile N`` adds a torch profile of N decode
steps (top ops by CPU time). ``ceiling`` (on unless ``--no-ceiling``) times the target's linear layers alone at the
job's decode and prefill widths: the most new tokens/s any engine could reach on this host (:func:`linear_ceiling`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from omegaconf import OmegaConf  # noqa: E402

from draftheads.data_prep.distill import select_prompts  # noqa: E402
from draftheads.data_prep.distill_engines import run_hf, run_slots  # noqa: E402
from draftheads.data_prep.shards import read_done  # noqa: E402
from draftheads.data_prep.template import ensure_chat_template, prompt_ids  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.job import enter_process  # noqa: E402
from draftheads.heads.target import TargetConfig, bf16_is_fast, dtype_name, load_target, resolve_device  # noqa: E402
from draftheads.scripts.bench_decode_attn import median_seconds  # noqa: E402


def cpu_facts() -> dict:
    """What the host computes natively (bf16 speed depends on it) and its model name."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    flags = set(next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), []))
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")),
                 platform.processor())
    return {"model": model, "cores": os.cpu_count(), "bf16_native": bf16_is_fast("cpu"),
            "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"})}


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> dict:
    kept = enter_process()  # as the distill job's entry does (DRAFTHEADS_MALLOC=system: off)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="slots,hf",
                    help="comma-separated, run in this order: slots | slots-separate (refills prefilled apart) | hf")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="max new tokens per answer")
    ap.add_argument("--batch", type=int, default=64, help="slot engine: KV-cache rows")
    ap.add_argument("--hf-batch", type=int, default=16, help="hf engine: left-padded batch (the job's old default)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--turns", default="first", choices=["first", "all"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", type=int, default=0, help="torch-profile this many slot decode steps")
    ap.add_argument("--decode-attention", default="auto", help="slots engine: auto | matmul | sdpa")
    ap.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the target's linear layers alone: the most this host could reach")
    ap.add_argument("--out", default="runs/bench/distill.json")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    target = load_target(TargetConfig(name=args.target, dtype=args.dtype), device=device)
    ensure_chat_template(target.tokenizer)
    load_s = time.perf_counter() - t0
    cfg = OmegaConf.create({
        "data": {"name": "sharegpt", "source": "sharegpt", "path": None, "heldout_fraction": 0.02, "split_seed": 0,
                 "split_by": "prompt", "on_error": "skip"},
        "num_conversations": args.prompts, "turns": args.turns, "batch_size": args.batch, "sort_block": 2048,
        "max_new_tokens": args.new, "max_prompt_tokens": args.max_prompt_tokens, "temperature": args.temperature,
        "top_p": 1.0, "top_k": 0, "seed": 0, "decode_attention": args.decode_attention,
        "eval_questions": [str(REPO.parent / "shared/data/mt_bench.jsonl")]})
    todo, info = select_prompts(cfg, target.tokenizer, *read_done(Path("/nonexistent")))
    firsts = sorted(len(prompt_ids(target.tokenizer, s + [{"role": "user", "content": u[0]}])) for _, s, u in todo)
    res = {"target": args.target, "dtype": dtype_name(target.dtype), "device": str(device),
           "malloc_kept": kept, "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
           "prompts": len(todo), "turns": args.turns, "max_new_tokens": args.new, "temperature": args.temperature,
           "median_first_prompt_tokens": firsts[len(firsts) // 2],
           "host_cpu": cpu_facts(), "torch": torch.__version__, "load_s": round(load_s, 1), "engines": {}}
    answers = {}
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine not in ("slots", "slots-separate", "hf"):
            raise ValueError(f"--engines: unknown engine {engine!r}; expected slots, slots-separate or hf")
        ecfg = OmegaConf.merge(cfg, {"batch_size": args.hf_batch if engine == "hf" else args.batch,
                                     "refill": "separate" if engine == "slots-separate" else "merged"})
        got: dict[str, list] = {}
        before = load_avg()
        t = time.perf_counter()
        stats = (run_hf if engine == "hf" else run_slots)(
            target, todo, ecfg, lambda c, msgs, fin: got.__setitem__(c.id, [m["content"] for m in msgs]))
        dt = time.perf_counter() - t
        answers[engine] = got
        res["engines"][engine] = {"batch": int(ecfg.batch_size), "seconds": round(dt, 2),
                                  "new_tokens": stats["new_tokens"],
                                  "tokens_per_s": round(stats["new_tokens"] / dt, 1), "load_before": before,
                                  "load_after": load_avg(), "stats": stats}
        if stats.get("drained_s"):  # every row busy until the queue ran dry: what a long job runs at
            res["engines"][engine]["tokens_per_s_all_rows_busy"] = round(
                stats["new_tokens_before_drain"] / stats["drained_s"], 1)
        print(engine, json.dumps(res["engines"][engine]), flush=True)
    e = res["engines"]
    if "slots" in e and "hf" in e:
        res["speedup_slots_over_hf"] = round(e["slots"]["tokens_per_s"] / e["hf"]["tokens_per_s"], 2)
        same = sum(answers["slots"].get(k) == v for k, v in answers["hf"].items())
        res["identical_conversations"] = f"{same}/{len(answers['hf'])}"  # bf16 rounds by batch shape: not all
    if "slots" in e and "slots-separate" in e:
        res["speedup_merged_over_separate_refills"] = round(
            e["slots"]["tokens_per_s"] / e["slots-separate"]["tokens_per_s"], 3)
        same = sum(answers["slots"].get(k) == v for k, v in answers["slots-separate"].items())
        res["identical_conversations_merged_separate"] = f"{same}/{len(answers['slots-separate'])}"
    if args.profile and "slots" in e:
        res["profile_top_ops"] = profile_decode(target, todo, cfg, args.profile)
    if args.ceiling and "slots" in e:
        st = e["slots"]["stats"]
        res["ceiling"] = linear_ceiling(target.model, args.batch, st["prefill_tokens"] / max(st["new_tokens"], 1))
        res["ceiling"]["slots_share_of_ceiling"] = round(
            e["slots"]["tokens_per_s"] / res["ceiling"]["new_tokens_per_s_linear_only"], 3)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "profile_top_ops"}))
    return res


@torch.inference_mode()
def linear_ceiling(model: torch.nn.Module, rows: int, prefill_per_new: float, prefill_rows: int = 2048,
                   reps: int = 5) -> dict:
    """The most new tokens/s any engine could distill at on this host, counting only the target's linear layers.

    Why: whatever an engine does about attention, padding or scheduling, every new token costs one pass through
    every linear layer at decode width (``rows`` tokens at once, lm_head included) and every prompt token one
    pass at prefill width (lm_head excluded: only a row's last position is sampled). Timing exactly those GEMMs
    (fused q|k|v and gate|up, as the slot engine runs them) gives an upper bound that needs no model of the
    kernels: ``1 / (1/decode_rate + prefill_per_new/prefill_rate)``. When the bound is below a target, no engine
    reaches it on this host without cutting arithmetic (a smaller or quantized target)."""
    p = model.get_output_embeddings().weight
    gemms = []  # (weight [out, in]) in the order a block runs them
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        gemms += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                  torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]

    def seconds(n: int, lm_head: bool) -> float:
        xs = {k: torch.randn(n, k, dtype=p.dtype, device=p.device) for k in {g.shape[1] for g in gemms} | {p.shape[1]}}

        def once() -> None:
            for w in gemms:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            if lm_head:
                torch.nn.functional.linear(xs[p.shape[1]], p)
        return median_seconds(once, reps)

    decode_rate = rows / seconds(rows, True)
    prefill_rate = prefill_rows / seconds(prefill_rows, False)
    bound = 1.0 / (1.0 / decode_rate + prefill_per_new / prefill_rate)
    gflop = 2 * (sum(w.numel() for w in gemms) + p.numel()) / 1e9
    return {"decode_rows": rows, "decode_linear_tokens_per_s": round(decode_rate, 1),
            "decode_linear_gflop_per_s": round(decode_rate * gflop, 1), "gflop_per_token": round(gflop, 6),
            "prefill_rows": prefill_rows,
            "prefill_linear_tokens_per_s": round(prefill_rate, 1),
            "prefill_tokens_per_new_token": round(prefill_per_new, 3),
            "new_tokens_per_s_linear_only": round(bound, 1), "load_after": load_avg()}


def profile_decode(target, todo, cfg, steps: int) -> list[dict]:
    """Top ops by self CPU time over ``steps`` decode steps of a full slot batch (prefill excluded)."""
    from draftheads.data_prep.fastgen import SlotDecoder

    tok = target.tokenizer
    n = min(int(cfg.batch_size), len(todo))
    dec = SlotDecoder(target.model, n, int(cfg.max_prompt_tokens) + int(cfg.max_new_tokens), str(cfg.decode_attention))
    nxt = torch.stack([dec.prefill(i, prompt_ids(tok, s + [{"role": "user", "content": u[0]}])).argmax()
                       for i, (_, s, u) in enumerate(todo[:n])])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            nxt = dec.decode(nxt).argmax(-1)
    rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:15]
    total = sum(a.self_cpu_time_total for a in prof.key_averages())
    return [{"op": a.key, "self_ms_per_step": round(a.self_cpu_time_total / 1e3 / steps, 2),
             "share": round(a.self_cpu_time_total / total, 3), "calls_per_step": a.count // steps} for a in rows]


if __name__ == "__main__":
    main()
