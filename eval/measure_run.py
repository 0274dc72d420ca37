"""Running the methods eval/measure.py compares: one timed turn (our decoding loop, or transformers' own generate
with its forwards timed alike), every question interleaved across methods, and the untimed warm-up.

Apart from the job and its summaries because this is the only part that decodes: a result row comes out of here.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Iterable, Sequence

import torch
from omegaconf import DictConfig

from draftheads.data_prep.template import prompt_ids
from draftheads.eval.generate import GenResult, NoDrafter, _clock, generate
from draftheads.eval.measure_methods import HF_KINDS, Method, Setting
from draftheads.heads.target import FrozenTarget

log = logging.getLogger(__name__)


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
