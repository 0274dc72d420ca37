"""Benchmark the target-feature pipeline and write JSON.

    python scripts/bench_features.py [--tiny] [--conversations 64] [--max-length 256] [--steps 8] \
        [--out runs/bench/features.json] [extra Hydra overrides for the features/eagle configs ...]

Measures, on the configured target (SmolLM2-135M by default, ``--tiny`` for a small random Llama with
SmolLM2's tokenizer):

* capture throughput against the target's bare forward (decoder only, no hooks, no copies) on exactly the
  same batches: interleaved batch by batch in one process (the robust ratio on a shared machine), and the
  whole ``data_prep/features.py`` job (forward + hooks + copies + shard writes) bracketed by two bare passes;
* bytes of cache per token (on disk, and the payload layers × H × dtype);
* EAGLE training tokens/s and peak memory online and offline, each in its own process: the process's max
  RSS (includes loading the target) and the peak RSS during the training loop alone; and the largest
  relative difference between the two loss curves (same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from draftheads.data_prep.dataset import collate, model_inputs, prepare_data  # noqa: E402
from draftheads.data_prep.features import main as features_main, resolve_layers, shard_batches  # noqa: E402
from draftheads.heads import job  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.target import dtype_name, load_target, parse_dtype  # noqa: E402


def compose(name: str, overrides: list[str]):
    from hydra import compose as hcompose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hcompose(config_name=name, overrides=overrides)


def make_tiny_target(root: Path) -> Path:
    """A random 4-layer Llama (hidden 256) with the embedded SmolLM2 tokenizer and chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draftheads.heads.target_source import resolve_embedded

    src, _ = resolve_embedded("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    d = root / "tiny-target"
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@torch.no_grad()
def bare_forward_tokens_per_s(target, ds, lengths, shards, batch_size: int, pad_id: int) -> float:
    """The target's decoder forward alone over the capture job's batches: batches are collated and on the
    device before the clock starts, and a warm-up batch is excluded."""
    base = target.model.get_decoder()
    batches = [idx for a, b in shards for idx in shard_batches(lengths, a, b, batch_size)]
    inputs = [{k: v.to(target.device) for k, v in model_inputs(collate([ds[i] for i in idx], pad_id)).items()
               if v is not None} for idx in batches]
    base(**inputs[0], use_cache=False)
    t0, tokens = time.perf_counter(), 0
    for idx, kw in zip(batches, inputs):
        base(**kw, use_cache=False)
        tokens += sum(lengths[i] for i in idx)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


@torch.no_grad()
def interleaved_capture_vs_bare(target, ds, lengths, shards, batch_size: int, pad_id: int, layers, dtype,
                                scratch: Path) -> dict:
    """Batch by batch, alternating which goes first: the bare decoder forward, then the capture path
    (collate + forward with hooks + unpad/copy to CPU in the cache dtype), plus each shard's write. Both
    see the same machine load, so the ratio is robust to a noisy shared machine."""
    from draftheads.data_prep.features import capture_batch, write_shard

    base = target.model.get_decoder()
    t_bare = t_cap = t_write = 0.0
    tokens = 0
    scratch.mkdir(parents=True, exist_ok=True)
    first = [ds[i] for i in shard_batches(lengths, *shards[0], batch_size)[0]]
    capture_batch(target, first, layers, dtype, pad_id)  # warm-up
    k = 0
    for a, b in shards:
        per_row = {}
        for idx in shard_batches(lengths, a, b, batch_size):
            rows = [ds[i] for i in idx]
            kw = {kk: v.to(target.device) for kk, v in model_inputs(collate(rows, pad_id)).items() if v is not None}
            for which in ((0, 1) if k % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if which == 0:
                    base(**kw, use_cache=False)
                    t_bare += time.perf_counter() - t0
                else:
                    for i, f in zip(idx, capture_batch(target, rows, layers, dtype, pad_id)):
                        per_row[i] = f
                    t_cap += time.perf_counter() - t0
            k += 1
            tokens += sum(lengths[i] for i in idx)
        t0 = time.perf_counter()
        write_shard(scratch / f"shard-{a}.safetensors", [per_row[i] for i in range(a, b)], layers)
        t_write += time.perf_counter() - t0
    return {"bare_forward_tokens_per_s": round(tokens / t_bare, 1),
            "capture_tokens_per_s": round(tokens / (t_cap + t_write), 1),
            "ratio_vs_bare": round(t_bare / (t_cap + t_write), 3), "write_share": round(t_write / (t_cap + t_write), 4),
            "batches": k, "tokens": tokens}


def train_run(overrides: list[str], out: Path) -> dict:
    """One EAGLE training job in its own process (so peak memory is its own)."""
    cmd = [sys.executable, str(REPO / "train" / "eagle.py"), *overrides, f"out_dir={out}", f"hydra.run.dir={out}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    s = json.loads((out / "summary.json").read_text())
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    return {"train_tokens_per_s": s["train_tokens_per_s"], "peak_rss_mb": s["peak_rss_mb"],
            "peak_rss_loop_mb": s.get("peak_rss_loop_mb"), "steps": s["steps"],
            "seconds_in_loop": s["seconds"], "wall_seconds": round(time.perf_counter() - t0, 1), "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small random Llama with the SmolLM2 tokenizer")
    ap.add_argument("--conversations", type=int, default=64, help="ShareGPT conversations to use")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per example")
    ap.add_argument("--batch-size", type=int, default=8, help="capture forward batch (bare forward uses the same)")
    ap.add_argument("--train-batch", type=int, default=4, help="training micro-batch")
    ap.add_argument("--steps", type=int, default=8, help="training steps per mode")
    ap.add_argument("--layers", default="[-1]", help="feature layers to capture")
    ap.add_argument("--out", default="runs/bench/features.json", help="result JSON")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (target=..., data=...)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    common = ["data=sharegpt_small", f"data.max_conversations={args.conversations}",
              f"data.max_length={args.max_length}", f"data.cache_dir={work / 'data'}"]
    if args.tiny:
        common += ["target=hf", f"target.name={make_tiny_target(work)}", "target.local_files_only=true"]
    common += args.overrides
    fcfg = compose("features", common + [f"layers={args.layers}", f"out={work / 'features'}",
                                         f"batch_size={args.batch_size}", "device=cpu"])
    # ---- capture vs bare forward on the same batches (bare before and after, to bracket machine noise)
    target = load_target(fcfg.target)
    data = prepare_data(fcfg.data, target.tokenizer)
    ds = data.train
    lengths = [len(x) for x in ds["input_ids"]]
    from draftheads.data_prep.features import plan_shards

    shards = plan_shards(len(ds), int(fcfg.rows_per_shard))
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    bare1 = bare_forward_tokens_per_s(target, ds, lengths, shards, args.batch_size, pad_id)
    del target
    cap = features_main(fcfg)
    manifest = json.loads((work / "features" / "manifest.json").read_text())
    target = load_target(fcfg.target)
    bare2 = bare_forward_tokens_per_s(target, ds, lengths, shards, args.batch_size, pad_id)
    layers = resolve_layers(list(fcfg.layers), target.num_layers)
    bare = (bare1 + bare2) / 2
    inter = interleaved_capture_vs_bare(target, ds, lengths, shards, args.batch_size, pad_id, layers,
                                        parse_dtype(fcfg.dtype), work / "scratch")
    del target
    # ---- training online vs offline
    tr = common + ["logging.wandb=disabled", "train.device=cpu", f"train.batch_size={args.train_batch}",
                   f"train.max_steps={args.steps}", "train.log_every=1", "train.save_every=0",
                   "train.eval_tokens=0", "optim.warmup_steps=0"]
    online = train_run(tr, work / "online")
    offline = train_run(tr + [f"features.dir={work / 'features'}"], work / "offline")
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(online["losses"], offline["losses"])]
    result = {
        "target": manifest["target"]["name"], "target_dtype": dtype_name(parse_dtype(fcfg.target.dtype)), "device": "cpu",
        "torch_threads": torch.get_num_threads(), "layers": layers, "cache_dtype": manifest["dtype"],
        "rows": manifest["data"]["rows"], "tokens": manifest["data"]["tokens"],
        "capture": {
            "interleaved": inter,
            "job_tokens_per_s": cap["tokens_per_s"], "bare_forward_tokens_per_s": round(bare, 1),
            "bare_forward_runs": [round(bare1, 1), round(bare2, 1)],
            "job_ratio_vs_bare": round(cap["tokens_per_s"] / bare, 3),
            "job_forward_share": round(manifest["capture"]["forward_seconds"] / manifest["capture"]["seconds"], 3),
        },
        "cache": {"disk_bytes": cap["disk_bytes"], "bytes_per_token": cap["bytes_per_token"],
                  "payload_bytes_per_token": manifest["bytes_per_token"],
                  "expected_bytes_printed": cap["expected_bytes"]},
        "training": {"online": online, "offline": offline,
                     "max_rel_loss_diff": max(diffs) if diffs else None,
                     "offline_speedup": round(offline["train_tokens_per_s"] / online["train_tokens_per_s"], 3)},
        "args": vars(args),
    }
    out = Path(args.out)
    atomic_write_text(out, json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "training"}, indent=2))
    print(json.dumps({m: {k: v for k, v in result["training"][m].items() if k != "losses"}
                      for m in ("online", "offline")}, indent=2))
    print(f"max relative loss difference online vs offline: {result['training']['max_rel_loss_diff']:.2e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    job.cli(main)
