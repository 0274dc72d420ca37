"""Measured τ during training: the real speculative loop (eval's own generation code, greedy) on a fixed slice
of the run's held-out split, so the trainer can keep the checkpoint with the best τ (``best/``).

Why measured and not the loss: τ peaks while the loss keeps falling (DeepSpec#84), and the teacher-forced
simulated τ (train/loop.py ``Trainer.simulated_tau``) weights positions differently from decoding. This runs
exactly what ``eval/acceptance.py`` runs on a head directory: ``eval.drafters.build_drafter`` (the family comes
from the checkpoint) and ``eval.acceptance.run_questions`` / ``summarize``.

The prompts are the first ``prompts`` questions of the prepared data's held-out questions file (the training
data's own held-out split, in hash order; never MT-bench or another eval file): first turns only, greedy,
``max_new_tokens`` each — fixed, so τ at different steps compares like with like.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from draftheads.data_prep.template import ensure_chat_template
from draftheads.eval.acceptance import run_questions, summarize
from draftheads.eval.autotree_knobs import fill_defaults
from draftheads.eval.drafters import build_drafter, checkpoint_family
from draftheads.eval.questions import load_questions
from draftheads.heads.schema import TreeConfig

log = logging.getLogger(__name__)

TREE_CONF = Path(__file__).resolve().parents[1] / "conf" / "tree" / "default.yaml"


def eval_tree(overrides: Any = None) -> Any:
    """conf/tree/default.yaml (the one truth for tree shapes, eval's and measure's too) with ``overrides`` on top."""
    yaml = OmegaConf.load(TREE_CONF)
    base = OmegaConf.merge(OmegaConf.structured(TreeConfig), {k: v for k, v in yaml.items() if k != "defaults"})
    if overrides:
        unknown = sorted(set(overrides) - set(base))
        if unknown:
            raise ValueError(f"train.tau_eval.evaluator.tree.{unknown[0]} is not a tree setting; allowed: "
                             f"{', '.join(sorted(base))} (see conf/tree/default.yaml)")
        base = OmegaConf.merge(base, overrides)
    return base


class TauEvaluator:
    """``evaluator(step, head_dir) -> metrics``: τ of the head in ``head_dir`` on fixed held-out prompts.

    ``target`` is the run's frozen target (the same object training uses; the generation loop only reads it),
    ``questions`` the prepared data's ``heldout_questions`` file. Rank 0 only: the loop calls it there."""

    def __init__(self, target: Any, questions: str | Path, prompts: int = 16, max_new_tokens: int = 64,
                 max_prompt_tokens: int = 1024, tree: Any = None, chat_template: str | None = None):
        for key, v in (("prompts", prompts), ("max_new_tokens", max_new_tokens),
                       ("max_prompt_tokens", max_prompt_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"train.tau_eval.evaluator.{key} must be a positive integer, got {v!r}")
        questions = Path(questions)
        if not questions.is_file() or not questions.read_text().strip():
            raise ValueError(f"train.tau_eval needs held-out prompts, but {questions} is missing or empty: give the "
                             f"data a held-out split (data.heldout_fraction > 0)")
        self.target = target
        ensure_chat_template(target.tokenizer, chat_template)
        self.questions = [dict(q, turns=q["turns"][:1]) for q in load_questions(questions, prompts)]
        self.source = str(questions)
        self.tree = eval_tree(tree)
        # the fields eval.acceptance.run_questions reads; greedy: τ is a property of the head, not of a sample
        self.gen = OmegaConf.create({"max_turns": 1, "max_new_tokens": max_new_tokens,
                                     "max_prompt_tokens": max_prompt_tokens, "mode": "greedy", "temperature": 1.0,
                                     "top_p": 1.0, "top_k": 0, "seed": 0, "extra_eos_ids": []})

    def __call__(self, step: int, head_dir: str | Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        # A fixed tree (knobs left to tree=auto take the family defaults): τ stays comparable from step to step
        # and no calibration runs inside training; sizing trees by their cost is the eval job's business.
        family = checkpoint_family(head_dir)
        tree, _ = fill_defaults(family, OmegaConf.to_container(self.tree, resolve=True), {})
        drafter, desc = build_drafter(family, self.target, str(head_dir), OmegaConf.create(tree), self.target.dtype)
        rows, _ = run_questions(self.target, drafter, self.questions, self.gen, desc=f"tau@{step}")
        s = summarize(rows, int(desc.get("tree_depth", 0)))
        out: dict[str, Any] = {"tau": s["tau"], "turns": s["turns"], "steps": s["steps"],
                               "new_tokens": s["new_tokens"], "tokens_per_s": s["tokens_per_s"],
                               "seconds": round(time.perf_counter() - t0, 2)}
        for d, a in enumerate(s["accept_at_depth"], start=1):
            out[f"accept@{d}"] = a
        log.info("step %d: measured tau %.4f on %d held-out prompts (%s)", step, s["tau"], s["turns"], self.source)
        return out
