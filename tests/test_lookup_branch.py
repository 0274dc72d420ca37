"""A prompt-lookup branch merged into a head's tree (eval/lookup_branch.py): the merge on toy trees (shared
prefixes, no duplicate siblings), greedy output equal to plain greedy (fp32) with the branch on, the branch
accepting where the text repeats, and sampled output following the target's distribution (χ²)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from draftheads.eval.drafters import with_lookup_branch
from draftheads.eval.eagle_drafter import EagleDrafter, EagleTreeConfig
from draftheads.eval.generate import NoDrafter, generate
from draftheads.eval.baselines import PromptLookupDrafter
from draftheads.eval.lookup_branch import LookupBranch, merge_chain
from draftheads.heads.eagle import EagleDraft, eagle_config_for
from draftheads.heads.target import from_model


def test_merge_shares_the_drafted_prefix_and_hangs_the_rest_under_it():
    tokens, parents = torch.tensor([9, 4, 5, 7]), torch.tensor([-1, 0, 0, 1])  # root 9: 4 -> 7, and 5
    t, p, nodes = merge_chain(tokens, parents, [4, 7, 8, 2])
    assert t.tolist() == [9, 4, 5, 7, 8, 2] and p.tolist() == [-1, 0, 0, 1, 3, 4] and nodes == [1, 3, 4, 5]
    t, p, nodes = merge_chain(tokens, parents, [6, 4])  # a first token the head did not draft: a new branch
    assert t.tolist() == [9, 4, 5, 7, 6, 4] and p.tolist() == [-1, 0, 0, 1, 0, 4] and nodes == [4, 5]
    t, p, nodes = merge_chain(tokens, parents, [5])  # all of it drafted already: nothing added
    assert t.tolist() == tokens.tolist() and nodes == [2]


@st.composite
def _tree_and_chain(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 5)) for _ in range(n)]
    seen = set()
    for i in range(1, n):  # a drafter never drafts one token twice under one parent
        while (parents[i], tokens[i]) in seen:
            tokens[i] += 6
        seen.add((parents[i], tokens[i]))
    return tokens, parents, draw(st.lists(st.integers(0, 5), max_size=8))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_tree_and_chain())
def test_merged_tree_keeps_the_tree_and_spells_the_chain(case):
    tokens, parents, chain = case
    t, p, nodes = merge_chain(torch.tensor(tokens), torch.tensor(parents), chain)
    t, p = t.tolist(), p.tolist()
    assert t[: len(tokens)] == tokens and p[: len(parents)] == parents  # the head's nodes stay where they were
    assert all(0 <= p[i] < i for i in range(1, len(p)))  # parents before children
    assert len({(p[i], t[i]) for i in range(1, len(p))}) == len(p) - 1  # no duplicate siblings
    assert [t[i] for i in nodes] == chain and len(t) - len(tokens) <= len(chain)
    for j, i in enumerate(nodes):  # the chain's nodes form one path down from the root
        assert p[i] == (nodes[j - 1] if j else 0)


def _eagle(tgt, seed: int = 0) -> EagleDraft:
    torch.manual_seed(seed)
    d = EagleDraft(eagle_config_for(tgt), tgt)
    for q in d.parameters():
        q.data.normal_(0, 0.3)  # random guesses: rejections exercise both caches' rollback
    return d


def test_greedy_with_the_branch_equals_plain_and_copies_repeats():
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=2))
    d = _eagle(tgt)
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3] * 6, list(range(20, 50))):
        ref = generate(tgt, NoDrafter(), prompt, 40).tokens
        head = generate(tgt, EagleDrafter(d, EagleTreeConfig(top_k=3, depth=2, nodes=6)), prompt, 40)
        drafter = LookupBranch(EagleDrafter(d, EagleTreeConfig(top_k=3, depth=2, nodes=6)), PromptLookupDrafter(6))
        res = generate(tgt, drafter, prompt, 40)
        assert res.tokens == ref == head.tokens, prompt
        assert res.tau >= head.tau - 0.05, (res.tau, head.tau)
    # the tiny random target loops, so copying pays: more accepted than the random head alone, wider trees
    assert res.tau > head.tau and drafter.merged_nodes > 0 and max(res.tree_sizes) > 7


def test_branch_is_a_tree_setting_of_any_head_and_off_at_zero():
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=2))
    inner = EagleDrafter(_eagle(tgt), EagleTreeConfig())
    d, desc = with_lookup_branch(inner, {"drafter": "eagle"}, {"lookup_branch": 4},
                                 {"lookup_max_ngram": 2, "lookup_min_ngram": 1})
    assert isinstance(d, LookupBranch) and desc["lookup_branch"] == 4 and d.lookup.max_ngram == 2
    assert d.layers == inner.layers and d.draft is inner.draft  # reports read the head's attributes through it
    assert with_lookup_branch(inner, {}, {"lookup_branch": 0})[0] is inner
    assert with_lookup_branch(inner, {}, {})[0] is inner
    with pytest.raises(ValueError, match="tree.lookup_branch"):
        with_lookup_branch(inner, {}, {"lookup_branch": -2})


@pytest.mark.slow
def test_sampled_exact_mode_with_the_branch_matches_target_distribution():
    from test_baselines import _chi2, peaky_case

    _, tgt, prompt, joint = peaky_case()
    drafter = LookupBranch(EagleDrafter(_eagle(tgt, 1), EagleTreeConfig(top_k=2, depth=2, nodes=3)),
                           PromptLookupDrafter(4))
    p, tv, acc = _chi2(tgt, drafter, prompt, joint, 600, "exact")
    print(f"eagle + lookup branch, exact: chi2 p={p:.3f} TV={tv:.3f} accepted/step={acc:.2f}")
    assert p > 0.01 and tv < 0.1 and acc > 0.1
