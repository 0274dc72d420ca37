"""The architecture matrix's table: ``python scripts/arch_matrix_table.py [--run]``.

The matrix itself is tests/test_arch_matrix.py: tiny random targets of every architecture below, each with every
family, through training, loading, the speculative loop and export. Its outcomes live in docs/architectures.json;
this script renders them as docs/architectures.md (a fast test checks the two agree). ``--run`` first runs the
matrix's slow cells (``pytest -m slow tests/test_arch_matrix.py``: 2 min on an idle 2-core host, 6 under load), which
write their outcomes to the JSON, with the transformers and torch versions they ran on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JSON_PATH = REPO / "docs" / "architectures.json"
MD_PATH = REPO / "docs" / "architectures.md"
OUT_ENV = "DRAFTHEADS_ARCH_MATRIX_OUT"  # where the test module writes the outcomes of the cells it ran

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_oss")
FAMILIES = ("medusa", "eagle", "eagle3", "block")
CHECKS = ("train", "load", "greedy", "ttt", "export")
WINDOW = 16  # sliding window of the architectures that have one
EAGER_ONLY = ("gemma2", "gpt_oss")  # no sdpa attention in transformers: the target runs eager attention


def attn_implementation(arch: str) -> str:
    return "eager" if arch in EAGER_ONLY else "sdpa"


def arch_config(arch: str) -> Any:
    """A tiny config of ``arch`` (4 layers, hidden 32, vocabulary 400 = the tests' tokenizer), built with its own
    Config class; the window, where the architecture has sliding-window layers, is 16 (prompts are 3 windows long)."""
    import transformers as T

    c: dict[str, Any] = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                             eos_token_id=2, bos_token_id=3)
    sw = dict(sliding_window=WINDOW)
    if arch == "llama":
        return T.LlamaConfig(**c, tie_word_embeddings=False)
    if arch == "mistral":  # every layer slides
        return T.MistralConfig(**c, **sw, tie_word_embeddings=False)
    if arch == "qwen2":  # layers >= max_window_layers slide
        return T.Qwen2Config(**c, **sw, use_sliding_window=True, max_window_layers=2, tie_word_embeddings=False)
    if arch == "qwen3":  # per-head q/k norms, tied embeddings
        return T.Qwen3Config(**c, head_dim=8, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(**c, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                tie_word_embeddings=False)
    if arch == "gemma2":  # alternating sliding/full layers, attention and final logit softcapping, tied embeddings
        return T.Gemma2Config(**c, **sw, head_dim=8, query_pre_attn_scalar=8)
    if arch == "gemma3_text":  # Gemma 3's pattern: sliding layers, then a full one; a rotary table per layer type
        return T.Gemma3TextConfig(**c, **sw, head_dim=8, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    if arch == "phi3":  # fused qkv and gate/up projections, every layer slides
        return T.Phi3Config(**c, **sw, tie_word_embeddings=False)
    if arch == "olmo2":  # norms after attention and MLP, q/k norms over all heads
        return T.Olmo2Config(**c, tie_word_embeddings=False)
    if arch == "gpt_oss":  # mixture of experts, attention sinks, alternating sliding/full layers
        return T.GptOssConfig(**{**c, "max_position_embeddings": 131072}, **sw, head_dim=8, num_local_experts=4,
                              num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2)
    raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHS}")


def attention_kind(arch: str) -> str:
    cfg = arch_config(arch)
    types = list(getattr(cfg, "layer_types", None) or [])
    sliding = sum(t == "sliding_attention" for t in types) if types else (cfg.num_hidden_layers
                                                                         if getattr(cfg, "sliding_window", None) else 0)
    if not sliding:
        return "full"
    if sliding == cfg.num_hidden_layers:
        return f"sliding {cfg.sliding_window} (all layers)"
    return f"sliding {cfg.sliding_window} ({sliding} of {cfg.num_hidden_layers} layers) + full"


def _cell(outcome: str) -> str:
    if outcome == "pass":
        return "✓"
    if outcome in ("n/a", "not run"):
        return "—"
    if outcome == "refused":
        return "refused ¹"
    if outcome.startswith("unsupported"):
        return "✗ unsupported ²"
    return "✗ " + outcome.replace("|", "\\|")


def render(data: dict[str, Any]) -> str:
    """docs/architectures.md from the recorded outcomes."""
    meta, cells = data.get("meta", {}), data["cells"]
    attention = meta.get("attention", {})  # written with the outcomes: rendering needs no model code
    lines = [
        "# Tested architectures",
        "",
        "<!-- generated by scripts/arch_matrix_table.py from docs/architectures.json: edit neither by hand -->",
        "",
        "Train a head for your own target, a local Hugging Face model directory (runs are offline; a hub id works "
        "with `target.local_files_only=false`):",
        "",
        "```bash",
        "python train/eagle3.py target=hf target.name=/path/to/model data=file data.path=my_chats.jsonl",
        "```",
        "",
        "`train/medusa.py`, `train/eagle.py` and `train/block.py` take the same arguments (`draftheads train eagle3 ...` is the same "
        "command). Gemma 2 and gpt-oss have no sdpa attention in transformers: add "
        "`target.attn_implementation=eager`. Then `python eval/acceptance.py checkpoint=runs/<run>/final "
        "target=hf target.name=/path/to/model` checks greedy identity and measures τ on your prompts. A GGUF file is "
        "a target too, `target.name=/path/to/model.gguf` (converted once and cached; chat templates and the embedded "
        "targets: [targets.md](targets.md)).",
        "",
        "## What passes",
        "",
        f"Each architecture as a tiny random model built from its transformers config class (4 layers, hidden 32, "
        f"vocabulary 400, sliding window {WINDOW} where it has sliding-window layers), each family through the real "
        f"entry points (`tests/test_arch_matrix.py`, transformers {meta.get('transformers', '?')}, torch "
        f"{meta.get('torch', '?')}, {meta.get('date', '?')}):",
        "",
        "- **train**: 12 steps of the family's trainer; the mean loss of the last 3 steps is below that of the "
        "first 3 (first → last step's loss shown).",
        "- **save/load**: the saved head loads back for the target with exactly the weights written.",
        "- **greedy**: fp32 greedy output through the speculative loop (the family's tree, built by eval's factory "
        "from the checkpoint) equals transformers' `generate`, 32 tokens after two prompts three windows long; and "
        "the target wrapper's logits equal the model's (what the exact sampling rule samples).",
        "- **trained as drafted** (EAGLE-3): the training-time test's rollout computes, step by step, what the "
        "chain drafter computes from the same features (the family's attention, masks and rotary positions).",
        "- **export**: `scripts/export.py format=speculators` (EAGLE-3 only), written and re-checked; ¹ refused "
        "with the export's own message where speculators has no draft layer of that type (it builds `llama` and "
        "`qwen3` layers).",
        "",
        "| architecture | attention | family | train (loss first → last) | save/load | greedy = plain | trained as "
        "drafted | export |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arch in ARCHS:
        for fam in FAMILIES:
            r = cells[arch][fam]
            loss = r.get("loss")
            train = _cell(r["train"]) + (f" {loss[0]:.3g} → {loss[1]:.3g}" if loss and r["train"] == "pass" else "")
            lines.append(f"| {arch} | {attention[arch]} | {fam} | {train} | {_cell(r['load'])} | "
                         f"{_cell(r['greedy'])} | {_cell(r['ttt'])} | {_cell(r['export'])} |")
    fails = [(a, f, c, cells[a][f][c]) for a in ARCHS for f in FAMILIES for c in CHECKS
             if cells[a][f][c].startswith(("fail", "unsupported"))]
    lines += ["", "## Not supported", ""]
    if fails:
        lines.append("² The family refuses the architecture with a one-line error before training (its later checks "
                     "do not run); ✗ alone is a failure:")
        lines.append("")
        lines += [f"- **{a} × {f}**, {c}: {o.split(': ', 1)[-1] if o.startswith('unsupported') else o}"
                  for a, f, c, o in fails]
    else:
        lines.append("Nothing in the matrix fails.")
    lines += [
        "",
        "## Notes",
        "",
        "- Sliding-window targets stay exact: the verification forward's tree mask is cut to each layer's window, "
        "and the target's KV cache keeps every position so a rejected tree can be rolled back "
        "(`tests/test_sliding_window.py`: greedy identity for every drafter and the exact rule's χ² on a Gemma-3 "
        "target, window 8, prompts several windows long). The cache is the full context's on every layer, as on a "
        "full-attention model of the same shape.",
        "- EAGLE and EAGLE-3 draft layers are built from the target's own layer class as full-attention layers: the "
        "draft sees the whole context whatever the target's window pattern.",
        "- The trainers' distillation targets (EAGLE, EAGLE-3) read the target's `lm_head` without Gemma 2's final "
        "logit softcap (30): the argmax is the same, the soft targets are sharper than the model's. Evaluation and the "
        "exact rule use the capped logits.",
        "",
    ]
    return "\n".join(lines)


def run_matrix(extra: list[str]) -> int:
    """Run the matrix's slow cells; merge their outcomes into docs/architectures.json with the versions used;
    pytest's exit code (a failing cell is recorded in the table and still fails the run)."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cells.json"
        env = {**os.environ, OUT_ENV: str(out)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "slow", "-p", "no:cacheprovider",
               "tests/test_arch_matrix.py", *extra]
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        if not out.is_file():
            raise SystemExit(f"the matrix wrote no outcomes (pytest exit {rc})")
        new = json.loads(out.read_text())
    data = json.loads(JSON_PATH.read_text()) if JSON_PATH.is_file() else {"cells": {}}
    for arch, fams in new.items():
        data["cells"].setdefault(arch, {}).update(fams)
    data["meta"] = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
                    "date": datetime.date.today().isoformat(), "attention": {a: attention_kind(a) for a in ARCHS}}
    JSON_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if rc:
        print(f"pytest exit {rc}: see the failures above (they are recorded in the table)", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the matrix's slow cells first (minutes)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments with --run, e.g. -k gemma")
    args = ap.parse_args(argv)
    rc = run_matrix(args.pytest_args) if args.run else 0
    MD_PATH.write_text(render(json.loads(JSON_PATH.read_text())))
    print(f"wrote {MD_PATH.relative_to(REPO)}")
    return rc


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(main)
