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

Outputs in ``out_dir``: ``results.json`` (atomic), ``report.md`` and PNG plots (eval/report.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from draftheads.data_prep.template import ensure_chat_template, prompt_ids
from draftheads.eval.acceptance import first_divergence
from draftheads.eval.autotree import MAX_WIDTH, configure, family_of, ratio
from draftheads.eval.calibration import Calibration, heldout_calibration
from draftheads.eval.baselines import DraftModelDrafter
from draftheads.eval.drafters import build_drafter, checkpoint_family
from draftheads.eval.generate import GenResult, NoDrafter, _clock, generate
from draftheads.eval.latency import cached_latency_profile, latency_profile, profile_key, store_profile, t_verify_ms
from draftheads.eval.questions import check_eval_limits, load_questions
from draftheads.heads import job, registry
from draftheads.heads.checkpoint import atomic_write_text
from draftheads.eval.tau import paired_forwards, tau
from draftheads.heads.target import FrozenTarget, dtype_name, load_target, resolve_device

log = logging.getLogger(__name__)

HF_KINDS = ("hf_plain", "hf_prompt_lookup")  # transformers' own generate(): the off-the-shelf peers
CHAIN_KINDS = ("prompt_lookup", "draft_model")  # sweep size = chain length + 1
TREE_KINDS = ("medusa-init", *registry.FAMILIES)  # sweep size = nodes verified per step
BUILTIN = ("plain",) + HF_KINDS + ("prompt_lookup", "draft_model", "medusa-init")


@dataclass
class Method:
    """One column of the comparison: a name, how it decodes, and (for trained heads) its checkpoint."""

    name: str
    kind: str  # plain | hf_plain | hf_prompt_lookup | prompt_lookup | draft_model | medusa | medusa-init | eagle(3)
    checkpoint: str | None = None
    size: int | None = None  # sweep point: tree size / chain length + 1 (None = configured default)
    drafter: Any = None
    desc: dict[str, Any] = field(default_factory=dict)
    choice: dict[str, Any] = field(default_factory=dict)  # tree=auto's report (empty when nothing was chosen)

    @property
    def label(self) -> str:
        return self.name if self.size is None else f"{self.name}@{self.size}"


@dataclass
class Setting:
    """A decoding setting every method is run under."""

    name: str  # "greedy", "T=0.7", ...
    mode: str  # greedy | exact | typical
    sampling: dict[str, Any] | None  # {temperature, top_p, top_k}; None for greedy


# --------------------------------------------------------------------------------------------
# Configuration → methods and settings
# --------------------------------------------------------------------------------------------

def resolve_methods(cfg: DictConfig) -> list[Method]:
    """Built-in method names from ``methods`` plus every entry of ``heads``; plain is always included."""
    heads = {str(k): str(v) for k, v in (cfg.get("heads") or {}).items()}
    names = [str(m) for m in (cfg.methods or [])]
    names += [h for h in heads if h not in names]
    if "plain" not in names:
        names.insert(0, "plain")  # speedups are relative to it
    if len(set(names)) != len(names):
        raise ValueError(f"methods must be unique, got {names}")
    out = []
    for n in names:
        if n in heads:
            out.append(Method(n, checkpoint_family(heads[n]), heads[n]))
        elif n in BUILTIN:
            out.append(Method(n, n))
        else:
            raise ValueError(f"unknown method {n!r}: expected one of {BUILTIN} or a label in heads {sorted(heads)}")
    return out


def decoding_settings(cfg: DictConfig) -> list[Setting]:
    out = [Setting("greedy", "greedy", None)] if cfg.greedy else []
    if cfg.sample_mode not in ("exact", "typical"):
        raise ValueError(f"sample_mode must be exact or typical, got {cfg.sample_mode!r}")
    for t in cfg.temperatures or []:
        if float(t) <= 0:
            raise ValueError(f"temperatures must be > 0 (greedy is its own setting), got {t}")
        out.append(Setting(f"T={float(t):g}", str(cfg.sample_mode),
                           {"temperature": float(t), "top_p": float(cfg.top_p), "top_k": int(cfg.top_k)}))
    if not out:
        raise ValueError("nothing to measure: greedy=false and no temperatures")
    return out


def sized_configs(method: Method, cfg: DictConfig, size: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tree cfg, baselines cfg) for a method at a sweep size: the size maps onto the family's own knob.

    A sweep point fixes its size and takes the family defaults for the other knobs (tree.select=default):
    the sweep shows the size axis; tree=auto chooses only for the main run (size None)."""
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    base = OmegaConf.to_container(cfg.baselines, resolve=True)
    if size is not None:
        if size < 2:
            raise ValueError(f"sweep sizes count the root too and must be >= 2, got {size}")
        tree["select"] = "default"
        if family_of(method.kind) == "static":
            tree["size"] = size
        elif family_of(method.kind) == "dynamic":
            tree["nodes"] = size - 1  # dynamic trees and the generic static tree (custom paths ignore it)
        elif method.kind == "prompt_lookup":
            base["lookup_tokens"] = size - 1
        elif method.kind == "draft_model":
            base["draft_tokens"] = size - 1
    return tree, base


def _make_drafter(m: Method, target: FrozenTarget, cfg: DictConfig, tree: dict[str, Any], base: dict[str, Any],
                  shared: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """(drafter, description) for concrete tree/baselines configs; the draft LM is loaded once and shared."""
    if m.kind == "draft_model" and shared is not None and "draft_model" in shared:
        d = DraftModelDrafter(shared["draft_model"], int(base["draft_tokens"]), target.vocab_size)
        return d, {**shared["draft_desc"], "tree_size": d.k + 1, "tree_depth": d.k}
    drafter, desc = build_drafter(m.kind, target, m.checkpoint, OmegaConf.create(tree), target.dtype,
                                  bool(cfg.allow_target_mismatch), int(cfg.untrained_heads), base)
    if m.kind == "draft_model" and shared is not None:
        shared["draft_model"], shared["draft_desc"] = drafter.model, dict(desc)
    return drafter, desc


def build_method(method: Method, target: FrozenTarget, cfg: DictConfig, size: int | None = None,
                 shared: dict[str, Any] | None = None, auto: "AutoContext | None" = None) -> Method:
    """Attach a drafter (None for transformers' generate) to a copy of ``method`` at ``size``.

    With ``auto`` (the main run), knobs left null are chosen by tree=auto (eval/autotree.py) on held-out
    calibration prompts; explicit ``tree.*`` / ``baselines.*`` values are kept."""
    m = Method(method.name, method.kind, method.checkpoint, size)
    if m.kind in HF_KINDS:
        m.desc = {"drafter": m.kind, "lookup_tokens": int(cfg.hf.lookup_tokens) if m.kind == "hf_prompt_lookup"
                  else None, "tree_size": 1 + int(cfg.hf.lookup_tokens) if m.kind == "hf_prompt_lookup" else 1}
        return m
    tree, base = sized_configs(m, cfg, size)
    if auto is None:
        tree["select"] = "default"
    make = lambda t, b: _make_drafter(m, target, cfg, t, b, shared)[0]  # noqa: E731
    tree, base, m.choice = configure(
        m.kind, target, tree, base, make, auto.calibration if auto else None, auto.profile if auto else None,
        m.checkpoint, int(cfg.untrained_heads), auto.eos if auto else ())
    m.drafter, m.desc = _make_drafter(m, target, cfg, tree, base, shared)
    if m.choice:
        m.desc = {**m.desc, "tree_select": "auto"}
        if "tree_source" in m.desc:
            m.desc["tree_source"] = "auto"
    return m


@dataclass
class AutoContext:
    """What tree=auto needs, computed once per job: the calibration split (lazily) and the latency profile."""

    cfg: DictConfig
    target: FrozenTarget
    qfile: Path
    questions: list[dict[str, Any]]
    profile_data: dict[str, Any]
    eos: set[int]
    calib: Calibration | None = None

    def calibration(self) -> Calibration:
        if self.calib is None:
            self.questions, self.calib = heldout_calibration(self.cfg, self.target, self.qfile, self.questions)
        return self.calib

    def profile(self) -> dict[str, Any]:
        """The job's profile when it reaches the widest tree considered, else the cached default one."""
        if max(p["width"] for p in self.profile_data["points"]) >= MAX_WIDTH:
            return self.profile_data
        return cached_latency_profile(self.target)


# --------------------------------------------------------------------------------------------
# Running one turn
# --------------------------------------------------------------------------------------------

def hf_generate(target: FrozenTarget, ids: Sequence[int], max_new_tokens: int, eos: Iterable[int],
                setting: Setting, lookup_tokens: int | None, max_ngram: int | None, seed: int) -> dict[str, Any]:
    """transformers' generate (plain or prompt-lookup assisted), timed, with its target forwards counted.

    Forward hooks time every target forward, so its steps, τ (tokens per forward after the prefill) and
    its own bookkeeping share are comparable with ours.
    """
    model, dev = target.model, target.device
    times: list[float] = []
    t_in: list[float] = []
    h1 = model.register_forward_pre_hook(lambda *a: t_in.append(_clock(dev)))
    h2 = model.register_forward_hook(lambda *a: times.append(_clock(dev) - t_in[-1]))
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), num_beams=1,
                              repetition_penalty=1.0, pad_token_id=target.tokenizer.pad_token_id
                              if target.tokenizer.pad_token_id is not None else sorted(eos)[0])
    if setting.sampling is None:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        s = setting.sampling
        kw.update(do_sample=True, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"])
    if lookup_tokens:
        kw["prompt_lookup_num_tokens"] = int(lookup_tokens)
        if max_ngram:
            kw["max_matching_ngram_size"] = int(max_ngram)
    x = torch.tensor([list(ids)], device=dev)
    torch.manual_seed(seed)
    try:
        t0 = _clock(dev)
        out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
        secs = _clock(dev) - t0
    finally:
        h1.remove()
        h2.remove()
    tokens = out[0, x.shape[1]:].tolist()
    eos_set = set(eos)
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos_set), len(tokens))
    tokens = tokens[:cut]
    steps = max(0, len(times) - 1)  # forwards after the prefill
    return {"tokens": tokens, "seconds": secs, "prefill_seconds": times[0] if times else 0.0,
            "target_seconds": sum(times[1:]), "draft_seconds": 0.0, "steps": steps,
            "accepted_total": max(0, len(tokens) - 1 - steps), "accepted": None, "tree_depths": None,
            "tree_sizes_mean": None, "stopped": "eos" if tokens and tokens[-1] in eos_set else "max_new_tokens"}


def run_turn(method: Method, target: FrozenTarget, ids: list[int], max_new_tokens: int, eos: set[int],
             setting: Setting, seed: int, cfg: DictConfig) -> dict[str, Any]:
    """Generate one answer with ``method``; return the timing/acceptance fields of a result row."""
    if method.kind in HF_KINDS:
        lookup = int(cfg.hf.lookup_tokens) if method.kind == "hf_prompt_lookup" else None
        if method.size is not None and lookup:
            lookup = method.size - 1
        return hf_generate(target, ids, max_new_tokens, eos, setting, lookup, cfg.hf.get("max_ngram"), seed)
    gen = torch.Generator().manual_seed(seed)
    drafter = method.drafter if method.drafter is not None else NoDrafter()
    res: GenResult = generate(target, drafter, ids, max_new_tokens, eos, mode=setting.mode,
                              sampling=setting.sampling, generator=gen)
    return {"tokens": res.tokens, "seconds": res.seconds, "prefill_seconds": res.prefill_seconds,
            "target_seconds": res.target_seconds, "draft_seconds": res.draft_seconds, "steps": res.steps,
            "accepted_total": sum(res.accepted), "accepted": res.accepted, "tree_depths": res.tree_depths,
            "tree_sizes_mean": (sum(res.tree_sizes) / len(res.tree_sizes)) if res.tree_sizes else 1.0,
            "stopped": res.stopped, "out_of_draft_vocab": out_of_draft_vocab(drafter, res.tokens)}


def out_of_draft_vocab(drafter: Any, tokens: Sequence[int]) -> int | None:
    """How many emitted tokens a draft with its own vocabulary (EAGLE-3) could never have proposed: each is a
    guaranteed rejection, so this share caps acceptance. None for drafters over the full target vocabulary."""
    t2d = getattr(getattr(drafter, "draft", None), "t2d", None)  # [V] bool: target id inside the draft vocab
    if t2d is None:
        return None
    return int((~t2d[torch.as_tensor(list(tokens), dtype=torch.long, device=t2d.device)]).sum())


def run_questions_interleaved(methods: list[Method], target: FrozenTarget, questions: list[dict[str, Any]],
                              setting: Setting, cfg: DictConfig, max_turns: int, max_new_tokens: int,
                              desc: str) -> list[dict[str, Any]]:
    """Every question, every turn, every method (each conditioned on its own earlier answers)."""
    from tqdm.auto import tqdm

    tok = target.tokenizer
    eos = {tok.eos_token_id} | set(int(e) for e in (cfg.get("extra_eos_ids") or []))
    rows = []
    for qi, q in enumerate(tqdm(questions, desc=desc, unit="q", mininterval=5.0)):
        for m in methods:
            msgs = [{"role": "system", "content": q["system"]}] if q.get("system") else []
            for ti, turn in enumerate(q["turns"][:max_turns]):
                msgs.append({"role": "user", "content": turn})
                ids = prompt_ids(tok, msgs)
                if cfg.max_prompt_tokens and len(ids) > int(cfg.max_prompt_tokens):
                    # per method: a later turn's prompt holds the method's own answers, so they can differ
                    # (ids and lengths only, never the text)
                    log.warning("%s/%s: question %s turn %d skipped: its prompt has %d tokens > max_prompt_tokens=%d",
                                desc, m.label, q["question_id"], ti + 1, len(ids), int(cfg.max_prompt_tokens))
                    break  # later turns would be longer still
                r = run_turn(m, target, ids, max_new_tokens, eos, setting, int(cfg.seed) + 1000 * qi + ti, cfg)
                answer = tok.decode([t for t in r["tokens"] if t not in eos], skip_special_tokens=True)
                msgs.append({"role": "assistant", "content": answer})
                r.update(method=m.label, setting=setting.name, question_id=q["question_id"], category=q["category"],
                         turn=ti, prompt_tokens=len(ids), new_tokens=len(r["tokens"]),
                         prompt_hash=hashlib.sha1(str(ids).encode()).hexdigest()[:12])
                rows.append(r)
    return rows


def warm_up(methods: list[Method], target: FrozenTarget, questions: list[dict[str, Any]], settings: list[Setting],
            cfg: DictConfig) -> None:
    """One short untimed generation per method and setting: first calls pay allocations and lazy inits."""
    n = int(cfg.warmup_tokens)
    if n <= 0:
        return
    eos = {target.tokenizer.eos_token_id}
    ids = prompt_ids(target.tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}])
    for s in settings:
        for m in methods:
            run_turn(m, target, ids, n, eos, s, int(cfg.seed), cfg)


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------

def formula_tau(alpha: float, k: int) -> float:
    """The seed's expected tokens per step with k drafts accepted i.i.d. with probability alpha."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def depth_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance by depth from per-step accepted counts and tree depths (speculative rows only).

    accept_at_depth[d-1] = P(accepted ≥ d) over all steps; conditional[d-1] = P(accepted ≥ d | accepted ≥
    d-1 and the tree reaches depth d). α pooled over depths = Σ successes / Σ trials is the i.i.d.
    estimate that the seed's formula assumes; formula τ averages (1 − α^(k+1))/(1 − α) over the steps'
    own depths k (steps that drafted nothing contribute 1).
    """
    acc = [a for r in rows if r.get("accepted") is not None for a in r["accepted"]]
    dep = [d for r in rows if r.get("tree_depths") is not None for d in r["tree_depths"]]
    if not acc:
        return {"accept_at_depth": [], "conditional_accept": [], "alpha": None, "formula_tau": None,
                "measured_tau": None, "max_depth": 0}
    K = max(dep) if dep else 0
    a, k = np.asarray(acc), np.asarray(dep)
    at_depth, cond, succ_total, trials_total = [], [], 0, 0
    for d in range(1, K + 1):
        succ = int((a >= d).sum())
        trials = int(((a >= d - 1) & (k >= d)).sum())
        at_depth.append(round(succ / len(a), 4))
        cond.append(round(succ / trials, 4) if trials else None)
        succ_total += succ
        trials_total += trials
    alpha = succ_total / trials_total if trials_total else 0.0
    ftau = float(np.mean([formula_tau(alpha, int(x)) for x in k]))
    return {"accept_at_depth": at_depth, "conditional_accept": cond, "alpha": round(alpha, 4),
            "formula_tau": round(ftau, 4), "formula_tau_at_max_depth": round(formula_tau(alpha, K), 4),
            "measured_tau": round(float((a + 1).mean()), 4), "max_depth": int(K)}


def aggregate(rows: list[dict[str, Any]], t1_ms: float | None = None) -> dict[str, Any]:
    """τ, throughput and the per-step time split of a set of turns."""
    steps = sum(r["steps"] for r in rows)
    new = sum(r["new_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    pre = sum(r["prefill_seconds"] for r in rows)
    tgt = sum(r["target_seconds"] for r in rows)
    drf = sum(r["draft_seconds"] for r in rows)
    book = secs - pre - tgt - drf
    per = lambda x: round(1000 * x / max(1, steps), 3)  # noqa: E731 - ms per verification step
    out = {"turns": len(rows), "steps": steps, "new_tokens": new, "seconds": round(secs, 3),
           "tau": round(tau(rows), 4), "tokens_per_s": round(new / max(secs, 1e-9), 3),
           "decode_tokens_per_s": round(max(0, new - len(rows)) / max(secs - pre, 1e-9), 3),
           "target_ms_per_step": per(tgt), "draft_ms_per_step": per(drf), "bookkeeping_ms_per_step": per(book),
           "prefill_s": round(pre, 3)}
    widths = [r["tree_sizes_mean"] * r["steps"] for r in rows if r.get("tree_sizes_mean") is not None]
    if widths:
        out["mean_tree_size"] = round(sum(widths) / max(1, sum(r["steps"] for r in rows
                                                                if r.get("tree_sizes_mean") is not None)), 3)
    oov = [r for r in rows if r.get("out_of_draft_vocab") is not None]
    if oov:  # share of emitted tokens outside an EAGLE-3 draft vocabulary (never proposable)
        out["draft_vocab_oov"] = round(sum(r["out_of_draft_vocab"] for r in oov)
                                       / max(1, sum(r["new_tokens"] for r in oov)), 4)
    if t1_ms:
        out["bookkeeping_pct_of_t1"] = round(100 * out["bookkeeping_ms_per_step"] / t1_ms, 2)
    if out["target_ms_per_step"]:
        out["bookkeeping_pct_of_verify"] = round(100 * out["bookkeeping_ms_per_step"] / out["target_ms_per_step"], 2)
    return out


def summarize_method(rows: list[dict[str, Any]], t1_ms: float | None) -> dict[str, Any]:
    out = aggregate(rows, t1_ms)
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    out["per_category"] = {c: aggregate(rs, t1_ms) for c, rs in sorted(cats.items())}
    out["depth"] = depth_stats(rows)
    return out


def greedy_identity(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Token-by-token comparison with plain greedy, on turns whose prompt is the same as plain's."""
    ref = {(r["question_id"], r["turn"]): r for r in ref_rows}
    comparable, identical, div = 0, 0, []
    for r in rows:
        p = ref.get((r["question_id"], r["turn"]))
        if p is None or p["prompt_hash"] != r["prompt_hash"]:
            continue  # an earlier turn diverged, so this prompt differs: not comparable
        comparable += 1
        d = first_divergence(r["tokens"], p["tokens"])
        r["first_divergence"] = d
        if d is None:
            identical += 1
        else:
            div.append(d)
    return {"comparable_turns": comparable, "identical": identical, "first_divergence": div,
            "median_first_divergence": statistics.median(div) if div else None}


def turns_skipped(questions: list[dict[str, Any]], by: dict[str, list[dict[str, Any]]],
                  max_turns: int) -> dict[str, int]:
    """Per method, turns asked for (the first ``max_turns`` of each question) that it never measured: a prompt
    longer than ``max_prompt_tokens`` ends its question early. Reported so that "80 questions" never hides 78."""
    asked = sum(min(len(q["turns"]), max_turns) for q in questions)
    return {name: asked - len(rows) for name, rows in by.items()}


def head_to_head(by: dict[str, list[dict[str, Any]]], names: list[str], seed: int = 0,
                 boot: int = 10000) -> list[dict[str, Any]]:
    """Every pair of heads measured together: B's target forwards saved over A on the same turns, with a
    paired-bootstrap 95% interval over questions (eval/tau.py; a question's turns are resampled together) - is a
    τ lead more than prompt noise?"""
    keyed = {n: {(r["question_id"], r["turn"]): r for r in by[n]} for n in names}
    return [paired_forwards(keyed[a], keyed[b], a, b, boot, seed, strict=False, cluster=lambda k: k[0])
            for i, a in enumerate(names) for b in names[i + 1:]]


def speedups(summ: dict[str, dict[str, Any]], ref: str) -> dict[str, Any]:
    """tokens/s of every method over ``ref``'s, overall and per category."""
    if ref not in summ:
        return {}
    base = summ[ref]
    out = {}
    for name, s in summ.items():
        cat = {c: round(v["tokens_per_s"] / base["per_category"][c]["tokens_per_s"], 3)
               for c, v in s["per_category"].items()
               if c in base["per_category"] and base["per_category"][c]["tokens_per_s"] > 0}
        out[name] = {"overall": round(s["tokens_per_s"] / max(base["tokens_per_s"], 1e-9), 3), "per_category": cat}
    return out


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
                                                          if m.kind in TREE_KINDS + CHAIN_KINDS]
    chosen = [m for m in methods if m.name in set(wanted)]
    unknown = set(wanted) - {m.name for m in methods}
    if unknown:
        raise ValueError(f"sweep.methods names {sorted(unknown)} that are not in methods")
    bad = [m.name for m in chosen if m.kind not in TREE_KINDS + CHAIN_KINDS + ("hf_prompt_lookup",)]
    if bad:
        raise ValueError(f"sweep.methods {bad} have no tree size to sweep")
    if not chosen:
        return {}
    points = []
    for m in chosen:
        sizes = sw.tree_sizes if m.kind in TREE_KINDS else sw.chain_sizes
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


def tree_choices(methods: list[Method], per_setting: dict[str, Any]) -> dict[str, Any]:
    """tree=auto per method: the chosen tree, its modeled speedup, and the greedy run's measured one and their ratio."""
    g = (per_setting.get("greedy") or {})
    out = {}
    for m in methods:
        if not m.choice:
            continue
        c = dict(m.choice)
        if g:
            c["measured_tau"] = g["methods"][m.name]["tau"]
            c["measured_speedup"] = g["speedup_vs_plain"][m.name]["overall"]
            c["measured_over_modeled"] = ratio(c["measured_speedup"], c["chosen"]["modeled_speedup"])
        out[m.name] = c
    return out


def headline(per_setting: dict[str, Any], methods: list[Method]) -> dict[str, Any]:
    """The best trained head (by greedy tokens/s) and what it buys over plain and over HF prompt lookup."""
    g = per_setting.get("greedy")
    if not g:
        return {}
    heads = [m.name for m in methods if m.checkpoint]
    cands = heads or [m.name for m in methods if m.kind in TREE_KINDS + CHAIN_KINDS]
    if not cands:
        return {}
    best = max(cands, key=lambda n: g["methods"][n]["tokens_per_s"])
    s = g["methods"][best]
    out = {"best": best, "trained": bool(heads), "tau": s["tau"], "tokens_per_s": s["tokens_per_s"],
           "speedup_vs_plain": g["speedup_vs_plain"][best]["overall"],
           "bookkeeping_ms_per_step": s["bookkeeping_ms_per_step"],
           "bookkeeping_pct_of_t1": s.get("bookkeeping_pct_of_t1")}
    if g.get("speedup_vs_hf_prompt_lookup"):
        out["speedup_vs_hf_prompt_lookup"] = g["speedup_vs_hf_prompt_lookup"][best]["overall"]
    if "greedy_identical" in g and best in g["greedy_identical"]:
        gi = g["greedy_identical"][best]
        out["greedy_identical"] = f"{gi['identical']}/{gi['comparable_turns']}"
    return out


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
