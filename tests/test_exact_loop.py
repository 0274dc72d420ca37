"""The exact sampling rule through the decoding loop, for every family's drafter.

``eval/exactness.py`` and tests/test_verify.py check the rule as a function; here ``generate()`` runs it as eval
does: the drafter built by ``build_drafter`` from a saved checkpoint (untrained random heads, so drafts are
accepted at some steps and rejected at others), the target's tree forward with its KV cache, verification,
cache commit and the drafter's ``accept``. The first emitted tokens of many seeded runs are compared with the
target's exact joint, enumerated on a 4-token vocabulary (chi-square and total variation, the harness's
``chi2_tv``). Negative controls show the check has power: a rule that samples the residual from p instead of
the target's residual (``eval.exactness.broken_verify_tree``), Medusa's typical acceptance, and a drafter that
reports a distribution q for children it did not sample from q.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import draftheads.eval.generate as generate_mod
from conftest import tiny_model
from draftheads.eval.drafters import build_drafter
from draftheads.eval.exactness import broken_verify_tree, chi2_tv
from draftheads.eval.generate import DraftTree, generate
from draftheads.eval.verify import apply_sampling
from draftheads.heads.target import FrozenTarget, from_model

V = 4  # vocabulary: the joint of 2 tokens has 16 cells, of 3 tokens 64
PROMPT = [1, 2, 3]
# temperature and top-k applied to the target (and handed to the drafter): two tokens per context have no mass, so
# a drafted token the target cannot emit must always be rejected, and few cells make the check sharp at few runs
SAMPLING = {"temperature": 0.9, "top_p": 1.0, "top_k": 2}
# block-dv: a block draft with its own vocabulary; block-tree: a block draft's static tree over its positions
FAMILIES = ("medusa", "eagle", "eagle3", "block", "block-dv", "block-tree")
# the family's tree settings as eval reads them (conf/tree/default.yaml keys): depth 2, two children at the root
# (the block draft proposes a chain of two, each token sampled from its position's q; its tree two siblings at the
# root, drawn from position 1's q without replacement, and a child under the first)
TREES = {"medusa": {"size": 5, "max_depth": 2}, "eagle": {"top_k": 2, "depth": 2, "nodes": 4},
         "eagle3": {"top_k": 2, "depth": 2, "nodes": 4}, "block": {"kind": "chain", "depth": 2}, "block-dv": {"kind": "chain", "depth": 2},
         "block-tree": {"kind": "static", "paths": [[0], [1], [0, 0]]}}
ALPHA, TV_FACTOR = 1e-3, 3.0  # eval/exactness.py's defaults for "consistent with the target"
SAMPLES_ITS_DRAFTS = ("block", "block-dv", "block-tree")  # drafters whose children are drawn from the q they report
# negative controls: (runs, p-value bound); others (400, 1e-10)
CONTROLS = {"block": (1000, 1e-5), "block-dv": (1000, 1e-5), "block-tree": (1000, 1e-5)}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return from_model(tiny_model("llama", vocab_size=V, layers=2, hidden=16, seed=3))


def _save_head(family: str, tgt: FrozenTarget, out: Path) -> Path:
    """An untrained head with random weights for ``tgt``, saved as training saves it."""
    torch.manual_seed(1)
    if family == "medusa":
        from draftheads.heads.medusa import MedusaHeads, medusa_config_for

        head: Any = MedusaHeads(medusa_config_for(tgt, 2, 1, False), tgt.lm_head())
        for p in head.parameters():
            p.data.normal_(0, 0.5)
    elif family == "eagle":
        from draftheads.heads.eagle import EagleDraft, eagle_config_for

        head = EagleDraft(eagle_config_for(tgt), tgt)
        for p in head.parameters():
            p.data.normal_(0, 0.3)
    elif family.startswith("block"):
        from draftheads.heads.block import BlockDraft, block_config_for

        dv = 3 if family == "block-dv" else 0  # as EAGLE-3's below: draft ids 0, 1, 2 are target ids 0, 1, 3
        head = BlockDraft(block_config_for(tgt, [0, 1], 1, 3, "kv", draft_vocab_size=dv), tgt)  # the shipped layout
        for p in head.parameters():  # peaked q: about half of the drafts are accepted
            p.data.normal_(0, 1.5) if p.ndim > 1 else p.data.uniform_(0.5, 1.5)
        if dv:
            head.set_vocab(torch.tensor([0, 1, 3]))
    else:
        from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for

        head = Eagle3Draft(eagle3_config_for(tgt, [0, 1], V - 1), tgt)
        # a draft vocabulary without token 2: draft ids map to target ids 0, 1, 3 (the target can emit 2, so the
        # drafts are still a proper subset of what it may say)
        head.set_vocab(torch.tensor([0, 1, 3]), init_lm_head_from=tgt.lm_head().weight)
        for p in head.parameters():
            p.data.normal_(0, 0.3) if p.ndim == 2 else p.data.uniform_(0.5, 1.5)
    head.save_pretrained(out, tgt.identity)
    return out


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, Any]:
    """Each family's drafter, built from its checkpoint by eval's factory."""
    out = {}
    for family in FAMILIES:
        head = _save_head(family, target, tmp_path_factory.mktemp(f"head-{family}"))
        drafter, desc = build_drafter("auto", target, str(head), OmegaConf.create(TREES[family]), target.dtype)
        assert desc["drafter"] == family.split("-")[0] and desc["tree_depth"] == 2
        out[family] = drafter
    return out


@torch.no_grad()
def target_joint(tgt: FrozenTarget, k: int) -> np.ndarray:
    """Exact joint [V]*k of the first k tokens after PROMPT under SAMPLING: one forward per (k-1)-token prefix."""
    prefixes = list(itertools.product(range(V), repeat=k - 1))
    logits = tgt(torch.tensor([PROMPT + list(s) for s in prefixes]))["logits"].double()  # [V^(k-1), P+k-1, V]
    probs = apply_sampling(logits, SAMPLING["temperature"], SAMPLING["top_p"], SAMPLING["top_k"]).numpy()
    P, joint = len(PROMPT), np.zeros([V] * k)
    for row, s in enumerate(prefixes):
        head = np.prod([probs[row, P - 1 + j, t] for j, t in enumerate(s)]) if s else 1.0
        joint[s] = head * probs[row, P + k - 2]
    assert abs(joint.sum() - 1.0) < 1e-9
    return joint


def sample_loop(tgt: FrozenTarget, drafter: Any, runs: int, k: int, seed: int, mode: str = "exact",
                ) -> tuple[np.ndarray, list[int], list[int]]:
    """Counts [V]*k of the first k tokens of ``runs`` seeded generate() calls; accepted drafts and tree depths per
    verification step."""
    gen = torch.Generator().manual_seed(seed)
    counts, accepted, depths = np.zeros([V] * k, dtype=np.int64), [], []
    for _ in range(runs):
        res = generate(tgt, drafter, PROMPT, k, mode=mode, sampling=SAMPLING, generator=gen)
        counts[tuple(res.tokens[:k])] += 1
        accepted += res.accepted
        depths += res.tree_depths
    return counts, accepted, depths


def fit(counts: np.ndarray, joint: np.ndarray) -> dict[str, Any]:
    """chi2_tv over the cells the target can emit, plus how many runs emitted a sequence it cannot (must be 0)."""
    st = chi2_tv(counts[joint > 0], joint[joint > 0])
    return {**st, "impossible": int(counts[joint == 0].sum())}


def consistent(st: dict[str, Any]) -> bool:
    return st["impossible"] == 0 and st["p_value"] > ALPHA and st["tv"] <= TV_FACTOR * st["tv_null"]


def _broken_rule(tokens, parents, target_probs, draft_probs=None, mode="exact", generator=None):
    """NEGATIVE CONTROL in the loop's call signature: accept with min(1, p/q) (p(t) for deterministic children) but
    never update p on a rejection, so the fallback sample comes from p instead of the residual."""
    return broken_verify_tree(tokens, parents, target_probs, draft_probs, generator=generator)


class ClaimsSampled:
    """NEGATIVE CONTROL: a drafter that picks its children deterministically (as every family's drafter does) but
    reports them as drawn from a distribution q, so the rule accepts with min(1, p/q) where it must use p."""

    def __init__(self, inner: Any):
        self.inner, self.layers = inner, inner.layers

    def begin(self, prompt_ids, hidden):
        self.inner.begin(prompt_ids, hidden)

    def propose(self, root, sampling, generator) -> DraftTree:
        tree = self.inner.propose(root, sampling, generator)
        n = tree.tokens.numel()
        q = torch.full((n, V), 0.1 / (V - 1), dtype=torch.float64)  # a peaked q at every drafted token
        q[torch.arange(n), tree.tokens] = 0.9
        return DraftTree(tree.tokens, tree.parents, q, tree.depths, tree.mask, tree.prefetch)

    def accept(self, tree, path, next_token, hidden):
        self.inner.accept(tree, path, next_token, hidden)


def _check_exercised(accepted: list[int], depths: list[int]) -> None:
    """Drafts were accepted at some steps and rejected at others, so both paths of the rule ran."""
    assert any(a > 0 for a in accepted), accepted
    assert any(a < d for a, d in zip(accepted, depths)), (accepted, depths)


@pytest.mark.parametrize("family", FAMILIES)
def test_loop_samples_the_target_distribution(family, target, drafters):
    """Fast: 150 runs, the joint of the first 2 tokens (the second one is the first verification step's)."""
    counts, accepted, depths = sample_loop(target, drafters[family], 150, 2, seed=0)
    st = fit(counts, target_joint(target, 2))
    assert consistent(st), (family, st)
    _check_exercised(accepted, depths)


def test_loop_detects_a_rule_that_samples_the_residual_from_p(target, drafters, monkeypatch):
    """Fast negative control: the same check, with the broken rule in the loop, rejects the output."""
    monkeypatch.setattr(generate_mod, "verify_tree", _broken_rule)
    counts, accepted, depths = sample_loop(target, drafters["eagle3"], 150, 2, seed=0)
    st = fit(counts, target_joint(target, 2))
    assert not consistent(st) and st["p_value"] < 1e-4, st
    _check_exercised(accepted, depths)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_loop_samples_the_target_distribution_over_three_tokens(family, target, drafters, monkeypatch):
    """Slow: 1000 runs, the joint of the first 3 tokens (depth-2 accepts, bonus tokens and a second step); every
    negative control, on 400 runs, detected by a wide margin."""
    joint = target_joint(target, 3)
    counts, accepted, depths = sample_loop(target, drafters[family], 1000, 3, seed=1)
    st = fit(counts, joint)
    assert consistent(st), (family, st)
    _check_exercised(accepted, depths)
    assert any(a == 2 for a in accepted), accepted  # whole-path accepts: the bonus token comes from the tree's leaf
    # the block draft samples its chain from q, so its controls' bias is smaller than for drafters with deterministic
    # children: more runs, and no "claims sampled" control (its premise is a drafter that does not sample)
    runs, bound = CONTROLS.get(family, (400, 1e-10))
    controls = [("typical", drafters[family], "typical")]
    if family not in SAMPLES_ITS_DRAFTS:
        controls.append(("claims_sampled", ClaimsSampled(drafters[family]), "exact"))
    for name, drafter, mode in controls:
        counts, _, _ = sample_loop(target, drafter, runs, 3, seed=2, mode=mode)
        st = fit(counts, joint)
        assert not consistent(st) and st["p_value"] < bound, (family, name, st)
    with monkeypatch.context() as m:
        m.setattr(generate_mod, "verify_tree", _broken_rule)
        counts, _, _ = sample_loop(target, drafters[family], runs, 3, seed=2)
    st = fit(counts, joint)
    assert not consistent(st) and st["p_value"] < bound, (family, "broken_residual", st)
