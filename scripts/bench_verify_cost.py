"""What one verification forward costs, split into the decoder body and the lm_head, per width. Writes JSON.

    python scripts/bench_verify_cost.py [--targets smollm2-135m gemma3-270m] [--dtype auto] [--context 300]
        [--widths 1 2 4 8 16 32 64] [--repeats 7] [--out runs/bench/verify_cost.json]

Why: speculative decoding pays when verifying N tokens costs little more than one (t_N / t_1 near 1). On a CPU the
lm_head is a large part of t_1 and grows with the vocabulary: each call reads the whole [V, H] weight, however few
rows it computes. A 262k-token vocabulary (Gemma 3) makes each verified token dearer than a 49k one (SmolLM2), and
makes every extra lm_head pass in a step cost nearly a whole one-token forward. Per target and width N this times,
on top of ``--context`` cached tokens (each the median of ``--repeats``, the cache cropped back between them):
the body over N new tokens (no logits), the lm_head over all N rows, and over one row (what the verification loop
computes per lm_head pass when it reads rows lazily, eval/generate.py LazyLogitRows). ``lm_head_share_t1`` is the
lm_head's part of a one-token forward. Numbers depend on the host and its load (the JSON records both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from draftheads.eval.generate import crop_cache
from draftheads.heads import job
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.target import FrozenTarget, TargetConfig, dtype_name, load_target, softcap


def median_ms(fn: Callable[[], Any], repeats: int, after: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` calls after one warm-up; ``after`` runs untimed after each."""
    fn()
    after()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        after()
    return 1000 * statistics.median(times)


@torch.no_grad()
def verify_cost(target: FrozenTarget, context: int, widths: list[int], repeats: int) -> dict[str, Any]:
    """Per width: body ms, lm_head ms over all rows and over one row, and their sum against a one-token forward."""
    dev = target.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context + max(widths)), generator=g).to(dev)  # [1, C + N]
    cache = target.new_cache()
    target(ids[:, :context], cache=cache, logits=False)
    head = target.lm_head()
    rows = []
    for n in widths:
        new = ids[:, context: context + n]  # [1, N]
        pos = torch.arange(context, context + n, device=dev)[None]  # [1, N]
        out = target(new, cache=cache, position_ids=pos, logits=False)
        crop_cache(cache, context)
        h = out["last_hidden"][0]  # [N, H]
        body = median_ms(lambda: target(new, cache=cache, position_ids=pos, logits=False), repeats,
                         lambda: crop_cache(cache, context))
        all_rows = median_ms(lambda: softcap(head(h), target.logit_softcap), repeats)
        one_row = median_ms(lambda: softcap(head(h[:1]), target.logit_softcap), repeats)
        rows.append({"width": n, "body_ms": round(body, 3), "lm_head_all_rows_ms": round(all_rows, 3),
                     "lm_head_one_row_ms": round(one_row, 3), "forward_ms": round(body + all_rows, 3)})
    t1 = rows[0]["forward_ms"] if widths[0] == 1 else None
    for r in rows:
        r["x_t1"] = round(r["forward_ms"] / t1, 3) if t1 else None
    one = next((r for r in rows if r["width"] == 1), None)
    return {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "layers": target.num_layers,
            "lm_head_mb": round(head.weight.numel() * head.weight.element_size() / 2 ** 20, 1),
            "lm_head_share_t1": round(one["lm_head_all_rows_ms"] / one["forward_ms"], 3) if one else None,
            "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", default=["smollm2-135m"], help="embedded names, directories or .gguf files")
    ap.add_argument("--dtype", default="auto", help="auto | bf16 | fp32 (auto: bf16 where native)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="runs/bench/verify_cost.json")
    args = ap.parse_args(argv)
    if args.context < 1 or args.repeats < 1 or min(args.widths) < 1:
        raise ValueError(f"--context {args.context}, --repeats {args.repeats} and every --widths value "
                         f"{args.widths} must be at least 1")
    widths = sorted(set(args.widths))
    result: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "load_average": [round(x, 2) for x in os.getloadavg()], "context": args.context,
                              "repeats": args.repeats, "targets": {}}
    for name in args.targets:
        target = load_target(TargetConfig(name=name, dtype=args.dtype), args.device)
        result["targets"][name] = {"dtype": dtype_name(target.dtype),
                                   **verify_cost(target, args.context, widths, args.repeats)}
        del target
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    job.cli(main)
