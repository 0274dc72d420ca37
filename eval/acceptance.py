"""Acceptance eval: τ (mean accepted + 1 per target forward) overall, per category and per depth,
tokens/s, and (optionally) a token-by-token check against plain greedy decoding.

    python eval/acceptance.py checkpoint=runs/medusa-.../final [questions=path/to/mt_bench.jsonl]

With ``questions=null`` the held-out split of ``data`` (prepared by data_prep) is the question set.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from draftheads.data_prep.dataset import prepare_data
from draftheads.data_prep.template import ensure_chat_template, prompt_ids
from draftheads.eval.autotree import configure, ratio, tree_label
from draftheads.eval.calibration import Calibration, heldout_calibration
from draftheads.eval.drafters import build_drafter, checkpoint_family
from draftheads.eval.generate import GenResult, NoDrafter, generate
from draftheads.eval.latency import cached_latency_profile
from draftheads.eval.questions import check_eval_limits, load_questions
from draftheads.eval.tau import tau_value
from draftheads.heads import job
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.heads.target import dtype_name, load_target, resolve_device

log = logging.getLogger(__name__)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(rows: list[dict[str, Any]], max_depth: int) -> dict[str, Any]:
    """τ overall and per category, acceptance by depth, throughput."""
    def agg(rs):
        steps = sum(len(r["accepted"]) for r in rs)
        acc = sum(sum(r["accepted"]) for r in rs)
        new = sum(r["new_tokens"] for r in rs)
        secs = sum(r["seconds"] for r in rs)
        return {"tau": round(tau_value(acc, steps), 4), "steps": steps, "new_tokens": new,
                "tokens_per_s": round(new / max(secs, 1e-9), 2), "turns": len(rs)}
    out = agg(rows)
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    out["per_category"] = {c: agg(rs) for c, rs in sorted(cats.items())}
    all_acc = [a for r in rows for a in r["accepted"]]
    out["accept_at_depth"] = [round(sum(a >= d for a in all_acc) / max(1, len(all_acc)), 4)
                              for d in range(1, max_depth + 1)]
    tgt = sum(r["target_seconds"] for r in rows)
    drf = sum(r["draft_seconds"] for r in rows)
    book = sum(r["bookkeeping_seconds"] for r in rows)
    out["time_split"] = {"target_s": round(tgt, 2), "draft_s": round(drf, 2), "bookkeeping_s": round(book, 2),
                         "target_forward_ms": round(1000 * tgt / max(1, out["steps"]), 2),
                         "bookkeeping_ms_per_step": round(1000 * book / max(1, out["steps"]), 2)}
    return out


def format_table(summary: dict[str, Any], title: str) -> str:
    lines = [title, f"{'category':<20} {'turns':>5} {'tau':>6} {'tok/s':>7}"]
    for c, s in summary["per_category"].items():
        lines.append(f"{c:<20} {s['turns']:>5} {s['tau']:>6.3f} {s['tokens_per_s']:>7.2f}")
    lines.append(f"{'overall':<20} {summary['turns']:>5} {summary['tau']:>6.3f} {summary['tokens_per_s']:>7.2f}")
    lines.append("accept@depth: " + " ".join(f"{a:.3f}" for a in summary["accept_at_depth"]))
    return "\n".join(lines)


def run_questions(target, drafter, questions, cfg, desc: str = "eval", reference: dict | None = None,
                  ) -> tuple[list[dict[str, Any]], dict]:
    """Answer every question (all turns, multi-turn on the model's own answers); return per-turn rows.

    ``reference`` maps (question_id, turn) -> token list of another run, for divergence reporting.
    """
    tok = target.tokenizer
    eos = {tok.eos_token_id} | set(cfg.get("extra_eos_ids") or [])
    gen = torch.Generator().manual_seed(int(cfg.seed))
    rows, outputs, skipped = [], {}, []
    for q in tqdm(questions, desc=desc, unit="q", mininterval=2.0):
        msgs = [{"role": "system", "content": q["system"]}] if q.get("system") else []
        for ti, turn in enumerate(q["turns"][: int(cfg.max_turns)]):
            msgs.append({"role": "user", "content": turn})
            ids = prompt_ids(tok, msgs)
            if cfg.max_prompt_tokens and len(ids) > int(cfg.max_prompt_tokens):
                skipped.append({"question_id": q["question_id"], "turn": ti, "prompt_tokens": len(ids)})
                break  # later turns would be longer still
            res: GenResult = generate(target, drafter, ids, int(cfg.max_new_tokens), eos, mode=cfg.mode,
                                      sampling={"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k},
                                      generator=gen)
            outputs[(q["question_id"], ti)] = res.tokens
            answer = tok.decode([t for t in res.tokens if t not in eos], skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": answer})
            row = {"question_id": q["question_id"], "category": q["category"], "turn": ti,
                   "prompt_tokens": len(ids), "new_tokens": len(res.tokens), "accepted": res.accepted,
                   "tau": round(res.tau, 4), "seconds": res.seconds, "target_seconds": res.target_seconds,
                   "draft_seconds": res.draft_seconds, "bookkeeping_seconds": res.bookkeeping_seconds,
                   "stopped": res.stopped}
            if reference is not None:
                row["first_divergence"] = first_divergence(res.tokens, reference.get((q["question_id"], ti), []))
            rows.append(row)
    if skipped:
        log.warning("skipped %d turns with prompts over %d tokens", len(skipped), cfg.max_prompt_tokens)
    return rows, outputs


def build_auto_drafter(cfg: DictConfig, target, qfile: Path, questions: list[dict[str, Any]],
                       ) -> tuple[Any, dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The drafter with its tree: explicit ``tree.*`` / ``baselines.*`` kept, null knobs chosen by tree=auto
    (eval/autotree.py, on held-out calibration prompts that are not among ``questions``) or defaulted.
    Returns (drafter, description, choice report, questions — fewer only if calibration had to borrow some)."""
    kind = cfg.drafter if cfg.drafter != "auto" else (checkpoint_family(cfg.checkpoint) if cfg.checkpoint else "plain")
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    base = OmegaConf.to_container(cfg.baselines, resolve=True) if cfg.get("baselines") is not None else {}
    args = (target, cfg.checkpoint)
    rest = (target.dtype, bool(cfg.allow_target_mismatch), int(cfg.untrained_heads))
    split: dict[str, Any] = {}

    def calibration() -> Calibration:
        split["questions"], split["calib"] = heldout_calibration(cfg, target, qfile, questions)
        return split["calib"]

    eos = {target.tokenizer.eos_token_id} | set(int(e) for e in (cfg.get("extra_eos_ids") or []))
    tree, base, choice = configure(
        kind, target, tree, base, lambda t, b: build_drafter(kind, *args, OmegaConf.create(t), *rest, b)[0],
        calibration, lambda: cached_latency_profile(target), cfg.checkpoint, int(cfg.untrained_heads), eos)
    drafter, desc = build_drafter(kind, *args, OmegaConf.create(tree), *rest, base)
    if choice:
        desc = {**desc, "tree_select": "auto", "tree_source": "auto" if "tree_source" in desc else None}
        desc = {k: v for k, v in desc.items() if v is not None}
    return drafter, desc, choice, split.get("questions", questions)


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    torch.manual_seed(int(cfg.seed))
    target = load_target(cfg.target, device=resolve_device(cfg.device))
    check_eval_limits(cfg, target)  # max_new_tokens=0, prompts past the context: errors, not τ 0.000
    ensure_chat_template(target.tokenizer, cfg.data.chat_template if "data" in cfg else None)
    if cfg.questions:
        qfile = Path(cfg.questions)
    else:  # the held-out split of the configured data (prepared on demand, cached)
        qfile = prepare_data(cfg.data, target.tokenizer).heldout_questions
    questions = load_questions(qfile, cfg.max_questions, cfg.get("per_category"))
    drafter, desc, choice, questions = build_auto_drafter(cfg, target, qfile, questions)
    max_depth = int(desc.get("tree_depth", 0))
    # ---- loop
    reference = None
    plain_summary = None
    if cfg.compare_plain:
        prow, reference = run_questions(target, NoDrafter(), questions, cfg, "plain")
        plain_summary = summarize(prow, 0)
    rows, _ = run_questions(target, drafter, questions, cfg, desc["drafter"], reference)
    summary = summarize(rows, max_depth)
    # ---- save
    result = {"drafter": desc, "questions": str(qfile), "num_questions": len(questions), "mode": cfg.mode,
              "dtype": dtype_name(target.dtype), "device": str(target.device),
              "max_new_tokens": int(cfg.max_new_tokens),
              "summary": summary,
              "target": target.identity.to_dict(), "rows": rows}
    if choice:  # tree=auto: what was chosen, what the model predicted, and (with compare_plain) what happened
        choice["measured_tau"] = summary["tau"]
        result["tree_choice"] = choice
    if plain_summary is not None:
        div = [r["first_divergence"] for r in rows]
        result["plain"] = plain_summary
        result["speedup_vs_plain"] = round(summary["tokens_per_s"] / max(plain_summary["tokens_per_s"], 1e-9), 3)
        if choice:
            choice["measured_speedup"] = result["speedup_vs_plain"]
            choice["measured_over_modeled"] = ratio(result["speedup_vs_plain"], choice["chosen"]["modeled_speedup"])
        result["greedy_identical"] = {"turns": len(div), "identical": sum(d is None for d in div),
                                      "first_divergence": [d for d in div if d is not None]}
    out = Path(cfg.out)
    atomic_write_text(out, json.dumps(result, indent=2))
    title = f"{desc['drafter']} on {qfile.name} ({cfg.mode}, {dtype_name(target.dtype)})"
    print(format_table(summary, title))
    if plain_summary is not None:
        gi = result["greedy_identical"]
        print(f"plain: {plain_summary['tokens_per_s']:.2f} tok/s; speedup {result['speedup_vs_plain']:.2f}x; "
              f"identical to plain greedy on {gi['identical']}/{gi['turns']} turns")
    if choice:
        c = choice["chosen"]
        print(f"tree=auto: {tree_label(c)}; E[accepted+1] modeled {c['expected_tokens']:.3f}, measured τ "
              f"{summary['tau']:.3f}; modeled speedup {c['modeled_speedup']:.2f}x"
              + (f", measured {choice['measured_speedup']:.2f}x (ratio {choice['measured_over_modeled']})"
                 if "measured_speedup" in choice else " (compare_plain=true measures it)"))
    print(f"wrote {out}")
    return result


@job.main(config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
