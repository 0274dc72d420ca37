"""Tests of the pure verification rules in eval/verify.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from draftheads.eval.verify import _residual, apply_sampling, tree_children, verify_tree

V = 5


def one_hot_rows(argmaxes: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).double()  # [N, V]


def random_probs(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows from Dirichlet(1) (normalized exponentials), floored so every token has mass."""
    x = -torch.log(torch.rand(n, vocab, generator=gen, dtype=torch.float64)) + 1e-3
    return x / x.sum(-1, keepdim=True)  # [N, V]


# ---------------------------------------------------------------------------
# Tree structure and input validation


def test_tree_children_lists_siblings_in_index_order() -> None:
    assert tree_children([-1, 0, 0, 1, 0, 3]) == [[1, 2, 4], [3], [], [5], [], []]
    assert tree_children(torch.tensor([-1])) == [[]]


@pytest.mark.parametrize("parents", [[], [0, 0], [-1, 1], [-1, 0, 2], [-1, -1], [-1, 0, 5]])
def test_tree_children_rejects_invalid_trees(parents: list[int]) -> None:
    with pytest.raises(ValueError):
        tree_children(parents)


def test_verify_tree_rejects_bad_inputs() -> None:
    tokens, parents = torch.tensor([0, 1, 2]), [-1, 0, 0]
    tp = torch.full((3, V), 1.0 / V)
    with pytest.raises(ValueError, match="unknown mode"):
        verify_tree(tokens, parents, tp, mode="nucleus")
    with pytest.raises(ValueError):
        verify_tree(tokens, [-1, 0], tp)  # parents length
    with pytest.raises(ValueError):
        verify_tree(tokens, parents, tp[:2])  # target rows
    with pytest.raises(ValueError):
        verify_tree(tokens, parents, tp, draft_probs=tp[:, :3])  # draft shape
    with pytest.raises(ValueError):
        verify_tree(torch.tensor([0, 1, V]), parents, tp)  # token out of vocab
    with pytest.raises(ValueError):
        verify_tree(tokens.float(), parents, tp)  # float tokens
    with pytest.raises(ValueError):
        verify_tree(tokens, parents, torch.zeros(3, V))  # root row has no mass


# ---------------------------------------------------------------------------
# Greedy


def test_greedy_walks_argmax_path_including_second_sibling() -> None:
    #        0
    #     /  |  \
    #    1   2   3        tokens 4, 2, 2   (argmax at root = 2 -> node 2, the second sibling)
    #   /   / \
    #  4   5   6          tokens 0, 3, 1   (argmax at node 2 = 1 -> node 6)
    #          |
    #          7          token 4          (argmax at node 6 = 0 -> no match, stop)
    parents = [-1, 0, 0, 0, 1, 2, 2, 6]
    tokens = torch.tensor([0, 4, 2, 2, 0, 3, 1, 4])
    argmaxes = [2, 0, 1, 3, 0, 0, 0, 3]
    tp = 0.5 * one_hot_rows(argmaxes) + 0.1  # not one-hot, but same argmax
    accepted, nxt = verify_tree(tokens, parents, tp, mode="greedy")
    assert accepted == [2, 6]
    assert nxt == 0


def test_greedy_no_match_at_root_and_full_path_bonus() -> None:
    parents = [-1, 0, 1]
    tokens = torch.tensor([0, 3, 1])
    assert verify_tree(tokens, parents, one_hot_rows([4, 1, 2]), mode="greedy") == ([], 4)
    assert verify_tree(tokens, parents, one_hot_rows([3, 1, 2]), mode="greedy") == ([1, 2], 2)


# ---------------------------------------------------------------------------
# Exact


@pytest.mark.parametrize("sampled", [True, False])
def test_exact_with_one_hot_target_equals_greedy(sampled: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5]
    n = len(parents)
    for _ in range(200):
        tokens = torch.randint(0, V, (n,), generator=gen)
        argmaxes = torch.randint(0, V, (n,), generator=gen)
        # Make matches likely: copy some argmaxes onto children.
        for i in range(1, n):
            if torch.rand(1, generator=gen).item() < 0.4:
                tokens[i] = argmaxes[parents[i]]
        tp = one_hot_rows(argmaxes.tolist())
        dp = None
        if sampled:
            dp = random_probs(n, V, gen)
            for i in range(1, n):  # the drafter must give the drafted token mass
                dp[i, tokens[i]] += 0.05
        want = verify_tree(tokens, parents, tp, mode="greedy")
        got = verify_tree(tokens, parents, tp, dp, mode="exact", generator=gen)
        assert got == want


def test_exact_accepts_everything_when_target_equals_draft() -> None:
    gen = torch.Generator().manual_seed(1)
    parents = [-1, 0, 0, 1, 1, 3, 2]
    kids = tree_children(parents)
    n = len(parents)
    for _ in range(100):
        q_at = random_probs(n, V, gen)  # drafter's distribution at each node
        tokens = torch.zeros(n, dtype=torch.long)
        for j in range(n):  # siblings without replacement from q_at[j]
            if kids[j]:
                tokens[kids[j]] = torch.multinomial(q_at[j], len(kids[j]), replacement=False, generator=gen)
        dp = q_at[[max(p, 0) for p in parents]]
        tp = q_at.clone()  # target at node i == drafter at node i
        accepted, nxt = verify_tree(tokens, parents, tp, dp, mode="exact", generator=gen)
        assert accepted == [1, 3, 5]  # always the first child, down to the leaf
        assert 0 <= nxt < V


def test_exact_duplicate_siblings_and_zero_prob_children_are_safe() -> None:
    gen = torch.Generator().manual_seed(2)
    parents = [-1, 0, 0, 0, 0]
    tokens = torch.tensor([0, 2, 2, 2, 3])
    tp = torch.tensor([[0.0, 0.5, 0.2, 0.0, 0.3]] + [[0.2] * V] * 4, dtype=torch.float64)
    dp = torch.tensor([[0.2] * V] + [[0.1, 0.1, 0.6, 0.1, 0.1]] * 4, dtype=torch.float64)
    counts = np.zeros(V)
    for draft in (None, dp):
        for _ in range(2000):
            accepted, nxt = verify_tree(tokens, parents, tp, draft, mode="exact", generator=gen)
            assert accepted in ([], [1], [4])  # duplicates 2 and 3 never accepted after 1 was rejected
            assert 0 <= nxt < V
            if not accepted:
                assert tp[0, nxt] > 0 and nxt not in (2, 3)  # rejected tokens are out of the residual
            if draft is None:  # fixed candidates are a valid deterministic tree: output must follow p
                counts[int(tokens[accepted[0]]) if accepted else nxt] += 1
    # token 3 has zero target mass: never emitted; emitted tokens follow p.
    # (With draft_probs the fixed duplicate tokens were not really drawn from q, so only validity is checked.)
    assert counts[3] == 0
    p = tp[0].numpy()
    assert stats.chisquare(counts[p > 0], p[p > 0] * counts.sum()).pvalue > 1e-3


def test_exact_all_children_impossible() -> None:
    gen = torch.Generator().manual_seed(3)
    parents = [-1, 0, 0]
    tokens = torch.tensor([0, 1, 1])
    tp = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0]] + [[0.2] * V] * 2, dtype=torch.float64)
    for _ in range(100):
        accepted, nxt = verify_tree(tokens, parents, tp, None, mode="exact", generator=gen)
        assert accepted == [] and nxt in (0, 2)


def test_exact_off_support_sampled_child_does_not_crash() -> None:
    gen = torch.Generator().manual_seed(4)
    parents = [-1, 0, 0]
    tokens = torch.tensor([0, 1, 4])
    tp = torch.full((3, V), 0.2, dtype=torch.float64)
    dp = torch.tensor([[0.2] * V, [0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    seen = set()
    for _ in range(500):
        accepted, nxt = verify_tree(tokens, parents, tp, dp, mode="exact", generator=gen)
        seen.add(tuple(accepted))
        assert 0 <= nxt < V and not math.isnan(nxt)
    assert seen <= {(), (1,), (2,)} and (2,) in seen  # q=0 child falls back to the one-hot rule


def test_residual_fallback_when_numerically_empty() -> None:
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    r = _residual(p, p.clone(), 2)  # p == q: residual has no mass
    assert torch.allclose(r, torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))
    one = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    assert torch.equal(_residual(one, None, 2), one)  # nothing left: keep p


def test_exact_single_chain_reproduces_target_marginal_and_joint() -> None:
    """Standard speculative sampling (a chain) with a bad drafter gives the target's (x1, x2)."""
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    vocab, k, rounds = 4, 3, 12000
    target = rng.dirichlet(np.ones(vocab), size=vocab) * 0.8 + 0.2 / vocab  # [V, V] p(next | last)
    draft = rng.dirichlet(np.full(vocab, 0.3), size=vocab) * 0.9 + 0.1 / vocab
    parents = [-1] + list(range(k))
    root = 0
    counts = np.zeros((vocab, vocab))
    n_accepted = 0
    for _ in range(rounds):
        toks = [root]
        for _ in range(k):
            toks.append(int(rng.choice(vocab, p=draft[toks[-1]])))
        tok_t = torch.tensor(toks)
        tp = torch.from_numpy(target[toks])  # [k+1, V]
        dp = torch.from_numpy(draft[[root] + toks[:-1]])  # row i: drafter at node i's parent
        accepted, nxt = verify_tree(tok_t, parents, tp, dp, mode="exact", generator=gen)
        assert accepted == list(range(1, len(accepted) + 1))
        n_accepted += len(accepted)
        out = [toks[a] for a in accepted] + [nxt]
        if len(out) == 1:  # x2 ~ target given x1 (what the next round would emit exactly)
            out.append(int(rng.choice(vocab, p=target[out[0]])))
        counts[out[0], out[1]] += 1
    joint = target[root][:, None] * target
    res = stats.chisquare(counts.ravel(), joint.ravel() * rounds)
    assert res.pvalue > 1e-3
    marg = stats.chisquare(counts.sum(1), target[root] * rounds)
    assert marg.pvalue > 1e-3
    alpha = np.minimum(target[root], draft[root]).sum()
    assert n_accepted / rounds > 0.5 * alpha  # it does accept (sanity: not a trivial pass)


def test_exact_same_seed_same_result() -> None:
    gen = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 1, 2]
    tokens = torch.tensor([0, 1, 2, 3, 4])
    tp, dp = random_probs(5, V, gen), random_probs(5, V, gen)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(123)
        runs.append([verify_tree(tokens, parents, tp, dp, generator=g) for _ in range(50)])
    assert runs[0] == runs[1]
    # parents given as a tensor behave the same
    g = torch.Generator().manual_seed(123)
    assert [verify_tree(tokens, torch.tensor(parents), tp, dp, generator=g) for _ in range(50)] == runs[0]


# ---------------------------------------------------------------------------
# Typical


def test_typical_accepts_plausible_candidates_and_samples_bonus() -> None:
    gen = torch.Generator().manual_seed(6)
    parents = [-1, 0, 0, 2]
    tokens = torch.tensor([0, 4, 1, 3])
    # Root: p(4)=0.01 (below threshold), p(1)=0.3 (above 0.09) -> node 2.
    # Node 2: one-hot at 0 -> H=0, threshold = min(0.09, 0.3) = 0.09; p(3)=0 -> stop.
    tp = torch.tensor(
        [[0.39, 0.3, 0.2, 0.1, 0.01], [0.2] * V, [1.0, 0.0, 0.0, 0.0, 0.0], [0.2] * V], dtype=torch.float64
    )
    for _ in range(20):
        assert verify_tree(tokens, parents, tp, mode="typical", generator=gen) == ([2], 0)
    # Flat target over 5 tokens: threshold = min(0.09, 0.3/5 = 0.06) -> every token (0.2) is accepted.
    flat = torch.full((4, V), 0.2, dtype=torch.float64)
    accepted, nxt = verify_tree(tokens, parents, flat, mode="typical", generator=gen)
    assert accepted == [1] and 0 <= nxt < V


def test_typical_threshold_uses_entropy() -> None:
    parents = [-1, 0]
    tokens = torch.tensor([0, 1])
    root = [0.3, 0.08, 0.25, 0.2, 0.17]
    p = torch.tensor([root, [0.2] * V], dtype=torch.float64)
    h = -sum(x * math.log(x) for x in root)
    thr = min(0.09, 0.3 * math.exp(-h))
    assert thr < 0.08 < 0.09  # high entropy lowers the threshold below epsilon
    gen = torch.Generator().manual_seed(0)
    assert verify_tree(tokens, parents, p, mode="typical", generator=gen)[0] == [1]
    # with delta = 0.5 the threshold is epsilon = 0.09 > 0.08: rejected
    assert verify_tree(tokens, parents, p, mode="typical", generator=gen, posterior_alpha=0.5)[0] == []


# ---------------------------------------------------------------------------
# apply_sampling


def test_apply_sampling_temperature() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0]])
    assert torch.equal(apply_sampling(logits, temperature=0), torch.tensor([[0.0, 1, 0, 0], [0, 0, 1, 0]]))
    assert torch.allclose(apply_sampling(logits), torch.softmax(logits, -1))
    assert torch.allclose(apply_sampling(logits, temperature=2.0), torch.softmax(logits / 2, -1))

    def entropy(p: torch.Tensor) -> torch.Tensor:
        return -(p * p.clamp_min(1e-30).log()).sum(-1)

    assert (entropy(apply_sampling(logits, temperature=0.5)) < entropy(apply_sampling(logits))).all()


def test_apply_sampling_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64))
    p = apply_sampling(logits, top_k=2)
    assert torch.allclose(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7], dtype=torch.float64))
    # top_p=0.5: 0.4 alone < 0.5, add 0.3 -> {1, 3}; top_p=0.35 -> just {1}; 0.75 -> {1, 3, 2}
    assert torch.allclose(apply_sampling(logits, top_p=0.5), p)
    assert torch.equal(apply_sampling(logits, top_p=0.35) > 0, torch.tensor([False, True, False, False]))
    assert torch.equal(apply_sampling(logits, top_p=0.75) > 0, torch.tensor([False, True, True, True]))
    assert torch.allclose(apply_sampling(logits, top_p=1.0, top_k=0), torch.softmax(logits, -1))
    assert torch.allclose(apply_sampling(logits, top_k=10), torch.softmax(logits, -1))
    both = apply_sampling(logits, top_k=3, top_p=0.6)  # top-3 renormalized: .44,.33,.22 -> keep {1, 3}
    assert torch.equal(both > 0, torch.tensor([False, True, False, True]))
    assert torch.allclose(both.sum(), torch.tensor(1.0, dtype=torch.float64))
    tied = apply_sampling(torch.zeros(6), top_k=2)
    assert int((tied > 0).sum()) == 2  # exactly k kept even with ties
    batched = apply_sampling(torch.randn(3, 7, 11), temperature=0.7, top_k=4, top_p=0.9)
    assert batched.shape == (3, 7, 11)
    assert torch.allclose(batched.sum(-1), torch.ones(3, 7))
    assert ((batched > 0).sum(-1) <= 4).all()


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}])
def test_apply_sampling_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        apply_sampling(torch.zeros(4), **kwargs)
