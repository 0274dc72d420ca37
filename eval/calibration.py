"""Calibration for tree=auto: held-out prompts, a probe run's per-depth/per-rank acceptance table, drafter timing.

* ``calibration_split``: a few held-out prompts that are never among the questions being measured.
* ``acceptance_table``: per step, the target's own continuation is looked up among the drafted nodes
  (rank = sibling order, best first) and counted hazard-style, P(rank r | not a lower rank), so a rank
  the probe tree did not draft is unobserved rather than a miss (chains: absent = miss).
* ``time_drafters``: per-step draft / bookkeeping / target time of drafters through the decoding loop.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from draftheads.eval.generate import generate

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Calibration prompts
# --------------------------------------------------------------------------------------------

@dataclass
class Calibration:
    """Held-out prompts that tree=auto measures on (first turns, chat-templated token ids)."""

    prompts: list[list[int]]
    question_ids: list[Any]
    source: str
    taken_from_eval: int = 0  # questions moved from the eval set because the held-out split had no others


def calibration_split(heldout: list[dict[str, Any]], heldout_file: str | Path, eval_file: str | Path,
                      eval_questions: list[dict[str, Any]], n: int, to_ids: Callable[[dict[str, Any]], list[int]],
                      max_prompt_tokens: int | None = None) -> tuple[list[dict[str, Any]], Calibration]:
    """Pick ``n`` calibration questions from the held-out split that are not being measured.

    The last questions of the held-out file come first. When the eval set *is* the held-out file and
    covers it, the last eval questions are moved to calibration (at least one stays in the eval set) —
    logged and recorded, so the measured questions and the calibration ones never overlap.
    """
    if n < 1:
        raise ValueError(f"tree.calibration.questions={n}: must be >= 1")
    same = Path(heldout_file).resolve() == Path(eval_file).resolve()
    measured = {q["question_id"] for q in eval_questions} if same else set()
    picked: list[tuple[dict[str, Any], list[int]]] = []
    for q in reversed(heldout):
        if len(picked) >= n:
            break
        if q["question_id"] in measured:
            continue
        ids = to_ids(q)
        if max_prompt_tokens and len(ids) > int(max_prompt_tokens):
            continue
        picked.append((q, ids))
    moved = 0
    questions = list(eval_questions)
    while same and len(picked) < n and len(questions) > 1:
        q = questions.pop()
        ids = to_ids(q)
        if max_prompt_tokens and len(ids) > int(max_prompt_tokens):
            continue
        picked.append((q, ids))
        moved += 1
    if not picked:
        raise ValueError(f"tree.select=auto needs calibration prompts from the held-out split {heldout_file}, and "
                         f"none is left beside the measured questions: give data more held-out conversations, or set "
                         f"tree.select=default or the tree knobs (tree.size / tree.top_k, tree.depth, tree.nodes)")
    if moved:
        log.warning("tree=auto: moved the last %d eval question(s) to calibration (the held-out split %s has no "
                    "other questions); %d questions are measured", moved, heldout_file, len(questions))
    return questions, Calibration([ids for _, ids in picked], [q["question_id"] for q, _ in picked],
                                  str(heldout_file), moved)


# --------------------------------------------------------------------------------------------
# Acceptance table from a probe run
# --------------------------------------------------------------------------------------------

class _Recorder:
    """Wraps a drafter (public protocol only) and records every step's tree and the text that followed."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.layers = tuple(getattr(inner, "layers", ()))
        self.steps: list[tuple[list[int], list[int], int]] = []  # (parents, tokens, root index in seq)
        self.runs: list[tuple[list[tuple[list[int], list[int], int]], list[int]]] = []
        self.seq: list[int] = []

    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self._flush()
        self.inner.begin(prompt_ids, hidden)

    def propose(self, root: int, sampling: Any, generator: Any) -> Any:
        tree = self.inner.propose(root, sampling, generator)
        if not self.seq:
            self.seq = [int(root)]
        self.steps.append((tree.parents.tolist(), tree.tokens.tolist(), len(self.seq) - 1))
        return tree

    def accept(self, tree: Any, path: Sequence[int], next_token: int, hidden: dict[int, torch.Tensor]) -> None:
        self.inner.accept(tree, path, next_token, hidden)
        self.seq.extend(int(tree.tokens[i]) for i in path[1:])
        self.seq.append(int(next_token))

    def _flush(self) -> None:
        if self.steps:
            self.runs.append((self.steps, self.seq))
        self.steps, self.seq = [], []

    def records(self, depth: int) -> list[tuple[list[int], list[int], list[int]]]:
        """(parents, tokens, continuation) per step: continuation = the next ``depth`` tokens after the root."""
        self._flush()
        return [(p, t, seq[i + 1:i + 1 + depth]) for steps, seq in self.runs for p, t, i in steps]


def acceptance_table(records: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]], max_depth: int,
                     max_rank: int, absent_is_miss: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-depth, per-rank acceptance from drafted trees and the continuations that followed them.

    ``records``: (parents [N], tokens [N], continuation) per step; children of a node in node order are
    its candidates best first (rank = sibling index). Walking the continuation down the tree, at each
    depth the ranks below the matching one are known misses and the matching one a hit; hazard
    h[d, r] = hits / trials, table[d, r] = h[d, r] · Π_{s<r} (1 − h[d, s]) = P(rank r | parent accepted).
    ``absent_is_miss``: a node with fewer children than ``max_rank`` (or none) proposed nothing more
    (chains) instead of leaving those ranks unobserved (trees cut by the probe's budget).
    Returns (table [D, R], trials [D, R], hits [D, R]).
    """
    trials = torch.zeros(max_depth, max_rank, dtype=torch.long)
    hits = torch.zeros(max_depth, max_rank, dtype=torch.long)
    for parents, tokens, cont in records:
        kids: dict[int, list[int]] = defaultdict(list)
        for i in range(1, len(parents)):
            kids[int(parents[i])].append(i)
        node = 0
        for d in range(min(max_depth, len(cont))):
            ch = kids.get(node, [])
            if not ch and not absent_is_miss:
                break  # the probe did not expand this node: unobserved
            found = next((j for j, c in enumerate(ch) if int(tokens[c]) == int(cont[d])), None)
            visible = max_rank if absent_is_miss else min(len(ch), max_rank)
            last = visible if found is None else min(found + 1, visible)
            trials[d, :last] += 1
            if found is not None and found < max_rank:
                hits[d, found] += 1
            if found is None:
                break
            node = ch[found]
    h = hits.double() / trials.clamp(min=1).double()  # [D, R] hazards (0 where never tried)
    survive = torch.cumprod(torch.cat([torch.ones(max_depth, 1, dtype=torch.float64), 1 - h[:, :-1]], dim=1), dim=1)
    return h * survive, trials, hits


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

@dataclass
class Timing:
    """Per-step costs of one drafter configuration, measured through the decoding loop."""

    config: dict[str, Any]
    width: float  # mean nodes verified per step (root included)
    draft_ms: float
    bookkeeping_ms: float
    target_ms: float
    steps: int


def time_drafters(target: Any, drafters: Sequence[tuple[dict[str, Any], Any]], prompts: Sequence[Sequence[int]],
                  new_tokens: int, rounds: int = 3) -> list[Timing]:
    """Per-step time split of each (config, drafter), decoding ``new_tokens`` after the prompts (EOS ignored, so
    every run has the same length). Round-robin over drafters, ``rounds`` times, so load drift hits all alike;
    each per-step time is the median over rounds, so one run caught by a burst of other jobs does not set it."""
    per: list[list[tuple[int, float, float, float, int]]] = [[] for _ in drafters]
    n = len(drafters)
    for r in range(max(1, rounds)):
        p = list(prompts[r % len(prompts)])
        for j in range(n):  # each round starts one drafter later: no drafter always runs right after another
            i = (j + r) % n
            res = generate(target, drafters[i][1], p, new_tokens, ())
            per[i].append((res.steps, res.draft_seconds, res.bookkeeping_seconds, res.target_seconds,
                           sum(res.tree_sizes)))
    out = []
    for (cfg, _), runs in zip(drafters, per):
        ok = [x for x in runs if x[0]]
        med = lambda i: 1000 * float(np.median([x[i] / x[0] for x in ok])) if ok else 0.0  # noqa: E731
        steps = sum(x[0] for x in runs)
        out.append(Timing(cfg, sum(x[4] for x in runs) / max(1, steps), med(1), med(2), med(3), steps))
    return out


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear interpolation, linear extrapolation past the ends (draft time keeps growing with depth)."""
    if len(xs) == 1:
        return float(ys[0])
    xs, ys = list(xs), list(ys)
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    xs, ys = [xs[i] for i in order], [ys[i] for i in order]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    if xs[i + 1] == xs[i]:
        return float(ys[i])
    return float(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))


def _book_line(timings: Sequence[Timing]) -> Callable[[float], float]:
    """Bookkeeping ms per step as a line in the width (least squares; flat with one distinct width)."""
    w = np.array([t.width for t in timings], dtype=float)
    b = np.array([t.bookkeeping_ms for t in timings], dtype=float)
    if len(set(w.tolist())) < 2:
        return lambda x: float(b.mean())
    slope, icpt = np.polyfit(w, b, 1)
    return lambda x: float(max(0.0, icpt + slope * x))



def heldout_calibration(cfg: Any, target: Any, qfile: str | Path, questions: list[dict[str, Any]],
                        ) -> tuple[list[dict[str, Any]], Calibration]:
    """Calibration prompts from ``cfg.data``'s held-out split, disjoint from the measured ``questions``."""
    from draftheads.data_prep.dataset import prepare_data
    from draftheads.data_prep.template import prompt_ids
    from draftheads.eval.questions import load_questions

    hfile = prepare_data(cfg.data, target.tokenizer).heldout_questions
    heldout = load_questions(hfile) if Path(hfile).read_text().strip() else []  # empty: calibration_split says what to do
    n = int((cfg.tree.get("calibration") or {}).get("questions") or 0)

    def to_ids(q: dict[str, Any]) -> list[int]:
        msgs = [{"role": "system", "content": q["system"]}] if q.get("system") else []
        return prompt_ids(target.tokenizer, msgs + [{"role": "user", "content": q["turns"][0]}])

    return calibration_split(heldout, hfile, qfile, questions, n, to_ids, cfg.get("max_prompt_tokens"))
