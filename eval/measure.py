"""Measurement job: every method through one harness, side by side, in one run.

    python eval/measure.py +heads.medusa=runs/medusa-.../final questions=../shared/data/mt_bench.jsonl

What it measures (all with the same target, dtype and KV cache type, questions interleaved across
methods so background load drifts hit every method alike):

* τ (accepted + 1 per verification forward) overall and per category, greedy and sampled (one run per
  temperature, exact verification), acceptance by tree depth, and the seed's cross-check
  τ ≈ (1 − α^(k+1)) / (1 − α) with α pooled from the measured per-depth acceptance;
* wall-clock tokens/s against plain decoding through the same loop and against transformers' built-in
  prompt-lookup assisted generation (``model.generate(..., prompt_lookup_num_tokens=10)``), per category;
* greedy identity with plain decoding, token by token (claim it in fp32 only; bf16 changes greedy text
  with the batch shape, so there the first-divergence positions are reported);
* the time split per step: target forward, draft, and bookkeeping (everything else: masks, verification,
  cache compaction), with bookkeeping as a % of a one-token target forward;
* the device's verification latency profile (1…128 tokens in one forward on a ~300-token cache) and, per
  tree size, the modeled speedup τ / ((t_verify(width) + t_draft) / t_1) so users pick the tree size for
  their hardware (plus the measured wall-clock speedup of the same sweep run).

Outputs in ``out_dir``: ``results.json`` (atomic), ``report.md`` and PNG plots (eval/report.py). The parts: what
is compared and at which size (eval/measure_methods.py), running it (eval/measure_run.py), the numbers
(eval/measure_summary.py); this file is the job that chains them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from draftheads.data_prep.template import ensure_chat_template
from draftheads.eval.latency import latency_profile, profile_key, store_profile, t_verify_ms
from draftheads.eval.measure_methods import (AutoContext, Method, Setting, build_method, decoding_settings,
                                             resolve_methods, sweep_axis)
from draftheads.eval.measure_run import run_questions_interleaved, warm_up
from draftheads.eval.measure_summary import (aggregate, greedy_identity, head_to_head, headline, speedups,
                                             summarize_method, tree_choices, turns_skipped)
from draftheads.eval.questions import check_eval_limits, load_questions
from draftheads.heads import job, registry
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.target import FrozenTarget, dtype_name, load_target, resolve_device

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------

def _questions(cfg: DictConfig, target: FrozenTarget) -> tuple[Path, list[dict[str, Any]]]:
    if cfg.questions:
        qfile = Path(cfg.questions)
    else:  # the held-out split of the configured data (prepared on demand, cached)
        from draftheads.data_prep.dataset import prepare_data

        qfile = prepare_data(cfg.data, target.tokenizer).heldout_questions
    return qfile, load_questions(qfile, cfg.max_questions, cfg.get("per_category"))


def run_sweep(methods: list[Method], target: FrozenTarget, questions: list[dict[str, Any]], cfg: DictConfig,
              profile: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """Greedy τ and draft cost per tree size → modeled and measured speedup over plain, per method."""
    sw = cfg.sweep
    wanted = sw.methods if sw.methods is not None else [m.name for m in methods
                                                          if registry.shape_of(m.kind).drafts]
    chosen = [m for m in methods if m.name in set(wanted)]
    unknown = set(wanted) - {m.name for m in methods}
    if unknown:
        raise ValueError(f"sweep.methods names {sorted(unknown)} that are not in methods")
    bad = [m.name for m in chosen if sweep_axis(m.kind) is None]
    if bad:
        raise ValueError(f"sweep.methods {bad} have no tree size to sweep")
    if not chosen:
        return {}
    points = []
    for m in chosen:
        sizes = sw[sweep_axis(m.kind)]
        points += [build_method(m, target, cfg, int(s), shared) for s in sizes]
    plain = Method("plain", "plain")
    qs = questions[: int(sw.max_questions)] if sw.max_questions else questions
    greedy = Setting("greedy", "greedy", None)
    rows = run_questions_interleaved([plain] + points, target, qs, greedy, cfg, 1, int(sw.max_new_tokens), "sweep")
    t1 = profile["t1_ms"]
    base = aggregate([r for r in rows if r["method"] == "plain"], t1)
    out: dict[str, Any] = {"questions": len(qs), "max_new_tokens": int(sw.max_new_tokens), "plain": base}
    for m in chosen:
        series = []
        for p in (p for p in points if p.name == m.name):
            s = aggregate([r for r in rows if r["method"] == p.label], t1)
            width = s.get("mean_tree_size", float(p.size))
            tv = t_verify_ms(profile, width)
            modeled = s["tau"] / ((tv + s["draft_ms_per_step"]) / t1) if t1 else None
            series.append({"size": p.size, "tau": s["tau"], "mean_tree_size": width, "t_verify_ms": round(tv, 3),
                           "draft_ms_per_step": s["draft_ms_per_step"],
                           "bookkeeping_ms_per_step": s["bookkeeping_ms_per_step"],
                           "modeled_speedup": round(modeled, 3) if modeled else None,
                           "measured_speedup": round(s["tokens_per_s"] / max(base["tokens_per_s"], 1e-9), 3),
                           "tokens_per_s": s["tokens_per_s"]})
        out[m.name] = series
    return out


def main(cfg: DictConfig) -> dict[str, Any]:
    t_job = time.perf_counter()
    load_start = _loadavg()
    torch.manual_seed(int(cfg.seed))
    target = load_target(cfg.target, device=resolve_device(cfg.device))
    check_eval_limits(cfg, target)  # max_new_tokens=0, prompts past the context: errors, not τ 0.000
    ensure_chat_template(target.tokenizer, cfg.data.chat_template if "data" in cfg else None)
    qfile, questions = _questions(cfg, target)
    settings = decoding_settings(cfg)
    shared: dict[str, Any] = {}

    # ---- the device's latency profile (before decoding, on a quiet cache); refreshes tree=auto's cached one
    pc = cfg.profile
    profile = latency_profile(target, list(pc.widths), int(pc.context), int(pc.repeats), int(cfg.seed))
    store_profile(profile, profile_key(target, list(pc.widths), int(pc.context), int(pc.repeats)))
    t1 = profile["t1_ms"]

    # ---- methods; tree=auto chooses null tree knobs on held-out calibration prompts (never these questions)
    eos = {target.tokenizer.eos_token_id} | set(int(e) for e in (cfg.get("extra_eos_ids") or []))
    auto = AutoContext(cfg, target, qfile, questions, profile, eos)
    methods = [build_method(m, target, cfg, None, shared, auto) for m in resolve_methods(cfg)]
    questions = auto.questions  # fewer only when the held-out split had no spare calibration prompts
    log.info("methods: %s; settings: %s", [m.name for m in methods], [s.name for s in settings])

    # ---- every setting, every question, every method (interleaved)
    warm_up(methods, target, questions, settings, cfg)
    all_rows: list[dict[str, Any]] = []
    per_setting: dict[str, Any] = {}
    for s in settings:
        rows = run_questions_interleaved(methods, target, questions, s, cfg, int(cfg.max_turns),
                                         int(cfg.max_new_tokens), s.name)
        by = {m.name: [r for r in rows if r["method"] == m.name] for m in methods}
        summ = {name: summarize_method(rs, t1) for name, rs in by.items()}
        for name, sm in summ.items():  # modeled speedup at the width each method actually verified
            w = sm.get("mean_tree_size")
            if w and t1:
                sm["modeled_speedup"] = round(sm["tau"] / ((t_verify_ms(profile, w) + sm["draft_ms_per_step"]) / t1), 3)
        block: dict[str, Any] = {"mode": s.mode, "sampling": s.sampling, "methods": summ,
                                 "speedup_vs_plain": speedups(summ, "plain"),
                                 "speedup_vs_hf_prompt_lookup": speedups(summ, "hf_prompt_lookup")}
        block["turns_skipped_long_prompt"] = turns_skipped(questions, by, int(cfg.max_turns))
        if s.mode == "greedy":
            block["greedy_identical"] = {n: greedy_identity(rs, by["plain"]) for n, rs in by.items() if n != "plain"}
            heads = [m.name for m in methods if m.checkpoint]
            if len(heads) > 1:
                block["head_to_head"] = head_to_head(by, heads, int(cfg.seed))
        per_setting[s.name] = block
        all_rows += rows

    tree_choice = tree_choices(methods, per_setting)

    # ---- tree-size sweep (greedy)
    sweep = run_sweep(methods, target, questions, cfg, profile, shared)

    result = {
        "target": target.identity.to_dict(), "dtype": dtype_name(target.dtype), "device": str(target.device),
        "load_average": {"start": load_start, "end": _loadavg()},  # other jobs on the machine skew wall clock
        "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "questions": str(qfile), "num_questions": len(questions), "max_turns": int(cfg.max_turns),
        "max_new_tokens": int(cfg.max_new_tokens),
        "methods": {m.name: {"kind": m.kind, "checkpoint": m.checkpoint, **m.desc} for m in methods},
        "latency_profile": profile, "settings": per_setting, "sweep": sweep, "tree_choice": tree_choice,
        "headline": headline(per_setting, methods),
        "config": OmegaConf.to_container(cfg, resolve=True), "job_seconds": round(time.perf_counter() - t_job, 1),
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in all_rows],
    }
    out_dir = Path(cfg.out_dir)
    atomic_write_text(out_dir / "results.json", json.dumps(result, indent=1, default=_json_default))
    from draftheads.eval.report import write_report

    files = write_report(result, out_dir)
    print(files["markdown_text"])
    print(f"wrote {out_dir / 'results.json'}, {', '.join(str(Path(f).name) for f in files['files'])}")
    return result


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return None if math.isnan(float(o)) else float(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


@job.main(config_name="measure")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
