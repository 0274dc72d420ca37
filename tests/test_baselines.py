"""Baseline drafters (prompt lookup, draft model) through the shared loop, and the loop's sampled modes.

Greedy: speculative output == plain greedy (fp32), token for token. Sampled (exact mode): the first
three emitted tokens follow the target's own (processed) distribution — χ² against the exact joint
p(x1) p(x2|x1) p(x3|x1,x2) computed from the target — while Medusa's typical acceptance, run through
the same harness, is rejected (so the test has power).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import tiny_model
from draftheads.eval.baselines import DraftModelDrafter, PromptLookupDrafter, truncated_target
from draftheads.eval.drafters import build_drafter
from draftheads.eval.generate import LazySampledProbs, NoDrafter, commit_tree_path, generate, keep_cache_positions
from draftheads.eval.verify import apply_sampling, verify_tree
from draftheads.heads.target import from_model


# --------------------------------------------------------------------------------------------
# Prompt lookup proposals on hand-built sequences
# --------------------------------------------------------------------------------------------

def _lookup(seq: list[int], **kw) -> list[int]:
    d = PromptLookupDrafter(**kw)
    d.begin(torch.tensor(seq[:-1]), {})
    return d.propose(seq[-1], None, None).tokens[1:].tolist()


def test_prompt_lookup_longest_ngram_wins():
    # suffix (5, 6, 7): the 3-gram occurs once (followed by 8 9); the 1-gram 7 occurs later (followed by 1)
    seq = [5, 6, 7, 8, 9, 2, 7, 1, 3, 5, 6, 7]
    assert _lookup(seq) == [8, 9, 2, 7, 1, 3, 5, 6, 7]  # up to the end of the known text
    assert _lookup(seq, max_ngram=1) == [1, 3, 5, 6, 7]  # only 1-grams: the most recent 7


def test_prompt_lookup_most_recent_occurrence_and_fallback():
    seq = [1, 2, 10, 11, 4, 1, 2, 20, 21, 4, 1, 2]  # the 3-gram (4, 1, 2) at 4..6, followed by 20 21 4 1 2
    assert _lookup(seq) == [20, 21, 4, 1, 2]
    # no earlier (8, 1, 2): fall back to the bigram (1, 2), whose most recent earlier occurrence (not the
    # first one, which transformers' prompt lookup would take) is followed by 20 21 8 1 2
    assert _lookup([1, 2, 10, 11, 9, 1, 2, 20, 21, 8, 1, 2]) == [20, 21, 8, 1, 2]
    assert _lookup([1, 2, 3, 4, 5, 6, 7]) == []  # nothing repeats: no proposal (a plain step)
    assert _lookup([3, 3]) == [3]  # the suffix itself is not a match; the earlier 3 is


def test_prompt_lookup_caps_at_num_tokens():
    seq = list(range(100, 130)) + [100]
    assert _lookup(seq) == list(range(101, 111))  # 10 tokens by default
    assert _lookup(seq, num_tokens=3) == [101, 102, 103]
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookupDrafter(num_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_prompt_lookup_matches_reference_scan():
    """The incremental n-gram index gives exactly the seed's lookup_propose on random text."""
    def reference(seq, i, max_ng=3, num=10):
        for ng in range(max_ng, 0, -1):
            if i - ng < 0:
                continue
            pat = seq[i - ng:i]
            for j in range(i - ng - 1, -1, -1):
                if seq[j:j + ng] == pat:
                    return seq[j + ng:min(j + ng + num, i)]
        return []

    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 300).tolist()
    d = PromptLookupDrafter()
    d.begin(torch.tensor(seq[:1]), {})
    for i in range(1, len(seq)):
        d.extend([seq[i]])
        assert d.lookup() == reference(seq, i + 1), i


# --------------------------------------------------------------------------------------------
# Greedy identity (fp32) through the shared loop
# --------------------------------------------------------------------------------------------

def _plain(tgt, prompt, n):
    return generate(tgt, NoDrafter(), prompt, n).tokens


def test_prompt_lookup_greedy_equals_plain():
    model = tiny_model("llama", vocab_size=64, seed=2)
    tgt = from_model(model)
    taus = []
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3] * 6, list(range(20, 50))):
        ref = _plain(tgt, prompt, 40)
        res = generate(tgt, PromptLookupDrafter(), prompt, 40)
        assert res.tokens == ref, prompt
        taus.append(res.tau)
    assert max(taus) > 1.5, taus  # random tiny models loop: lookup must actually accept something


def test_draft_model_greedy_equals_plain():
    model = tiny_model("llama", vocab_size=64, seed=2)
    tgt = from_model(model)
    other = tiny_model("llama", vocab_size=64, seed=9, layers=2)  # unrelated small draft: many rejections
    prompt = [5, 9, 17, 3, 22, 8]
    ref = _plain(tgt, prompt, 50)
    for draft, k in ((other, 3), (truncated_target(tgt, 2), 4), (model, 4)):
        res = generate(tgt, DraftModelDrafter(draft, k), prompt, 50)
        assert res.tokens == ref, k
    # the target as its own draft agrees with itself: every step accepts all k (but the last)
    res = generate(tgt, DraftModelDrafter(model, 4), prompt, 50)
    assert all(a == 4 for a in res.accepted[:-1]) and res.tau > 4.5, res.accepted


def test_draft_model_cache_rolls_back_to_accepted_prefix():
    """After every accept(), the draft cache equals a fresh prefill of the accepted text."""
    draft = tiny_model("llama", vocab_size=64, seed=4, layers=2)
    d = DraftModelDrafter(draft, k=3)
    text = [4, 8, 15, 16, 23, 42]  # prompt
    d.begin(torch.tensor(text), {})
    root = 7
    for m in (0, 2, 3, 1, 3, 0):  # accepted drafts per step, including "all k" (last draft never fed)
        tree = d.propose(root, None, None)
        assert tree.tokens.numel() == 4 and tree.draft_probs is None
        d.accept(tree, list(range(m + 1)), 50 + m, {})
        text = text + [root] + tree.tokens[1:m + 1].tolist()
        root = 50 + m
        assert d.n_cached + len(d.pending) == len(text)
        assert text[d.n_cached:] == d.pending
        fresh = d.new_cache()
        draft(input_ids=torch.tensor([text[:d.n_cached]]), past_key_values=fresh, use_cache=True)
        assert d.cache.get_seq_length() == d.n_cached
        for a, b in zip(d.cache.layers, fresh.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


def test_build_baseline_drafters_and_errors(tiny_target_dir):
    tgt = from_model(tiny_model("llama"))
    d, desc = build_drafter("prompt_lookup", tgt, None, {}, torch.float32, baselines={"lookup_tokens": 5})
    assert isinstance(d, PromptLookupDrafter) and desc["tree_size"] == 6
    d, desc = build_drafter("draft_model", tgt, None, {}, torch.float32,
                            baselines={"draft_model": "self:2", "draft_tokens": 3})
    assert isinstance(d, DraftModelDrafter) and d.k == 3 and desc["tree_depth"] == 3
    with pytest.raises(ValueError, match="draft_model="):
        build_drafter("draft_model", tgt, None, {}, torch.float32, baselines={})
    with pytest.raises(ValueError, match="1 <= n"):
        build_drafter("draft_model", tgt, None, {}, torch.float32, baselines={"draft_model": "self:4"})
    # a real checkpoint directory with a different tokenizer is refused
    from conftest import CHATML, make_tokenizer

    tgt.tokenizer = make_tokenizer(CHATML, vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer"):
        build_drafter("draft_model", tgt, None, {}, torch.float32, baselines={"draft_model": str(tiny_target_dir)})


# --------------------------------------------------------------------------------------------
# Loop internals: O(path) cache compaction and lazily processed target rows
# --------------------------------------------------------------------------------------------

def test_commit_tree_path_equals_index_select():
    tgt = from_model(tiny_model("llama", vocab_size=64))
    for path in ([0, 2, 5], [0, 1, 2], [0], [0, 3]):
        caches = []
        for _ in range(2):
            c = tgt.new_cache()
            tgt(torch.arange(1, 15)[None], cache=c)  # 14 positions: cur = 8 prefix + a 6-node "tree"
            caches.append(c)
        commit_tree_path(caches[0], 8, path)
        keep_cache_positions(caches[1], torch.cat([torch.arange(8), 8 + torch.tensor(path)]))
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_lazy_sampled_probs_match_dense_verification():
    torch.manual_seed(0)
    logits = torch.randn(9, 50) * 3
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 6])
    tokens = logits.argmax(-1).roll(1)
    tokens[0] = 0
    greedy = LazySampledProbs(logits.bfloat16(), None)  # greedy: raw rows as float32 (same argmax)
    assert greedy[3].dtype == torch.float32 and torch.equal(greedy[3], logits.bfloat16()[3].float())
    assert verify_tree(tokens, parents, greedy, None, "greedy") == verify_tree(tokens, parents, logits.bfloat16(),
                                                                                None, "greedy")
    for s in ({"temperature": 0.7}, {"temperature": 1.0, "top_p": 0.8, "top_k": 5}):
        lazy = LazySampledProbs(logits, s)
        dense = apply_sampling(logits, s.get("temperature", 1.0), s.get("top_p", 1.0), s.get("top_k", 0))
        torch.testing.assert_close(lazy.dense(), dense)
        for seed in range(20):
            a = verify_tree(tokens, parents, LazySampledProbs(logits, s), None, "exact",
                            torch.Generator().manual_seed(seed))
            b = verify_tree(tokens, parents, dense, None, "exact", torch.Generator().manual_seed(seed))
            assert a == b


# --------------------------------------------------------------------------------------------
# Sampled speculative generation reproduces the target's distribution (χ²)
# --------------------------------------------------------------------------------------------

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 3}  # applied to target p and draft q alike


def _peaky(seed: int, noise: float = 0.0):
    """A tiny fp32 Llama over 16 tokens with confident logits (top-3 mass spread unevenly)."""
    m = tiny_model("llama", vocab_size=16, layers=2, hidden=32, seed=seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
        g = torch.Generator().manual_seed(seed + 100)
        for p in m.model.layers[1].parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return m


def _exact_joint(model, prompt, s) -> dict[tuple[int, int, int], float]:
    """p(x1, x2, x3) of the target's processed distribution, by enumeration."""
    def dist(seq):
        with torch.no_grad():
            return apply_sampling(model(torch.tensor([seq])).logits[0, -1].double(), s["temperature"], s["top_p"],
                                  s["top_k"])
    out = {}
    p1 = dist(prompt)
    for a in p1.nonzero().view(-1).tolist():
        p2 = dist(prompt + [a])
        for b in p2.nonzero().view(-1).tolist():
            p3 = dist(prompt + [a, b])
            for c in p3.nonzero().view(-1).tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def _chi2(tgt, drafter, prompt, joint, n, mode, seed=0) -> tuple[float, float, float]:
    """(χ² p-value, TV distance, mean accepted drafts per step) of n sampled 3-token continuations."""
    g = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    acc = []
    for _ in range(n):
        r = generate(tgt, drafter, prompt, 3, mode=mode, sampling=SAMPLING, generator=g)
        k = tuple(r.tokens[:3])
        counts[k] = counts.get(k, 0) + 1
        acc += r.accepted
    keys = sorted(joint)
    exp = np.array([joint[k] * n for k in keys])
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    assert obs.sum() == n, "sampled a token outside the processed target's support"
    small = exp < 5  # pool sparse cells so the χ² approximation holds
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    tv = 0.5 * float(np.abs(obs - exp).sum()) / n
    return float(stats.chisquare(obs, exp).pvalue), tv, float(np.mean(acc))


def peaky_case() -> tuple:
    """(target model, its FrozenTarget, prompt, exact 3-token joint): the χ² harness's fixed case."""
    target = _peaky(5)
    prompt = [3, 7, 1, 9, 12, 1, 10, 3, 1, 12]
    return target, from_model(target), prompt, _exact_joint(target, prompt, SAMPLING)


@pytest.mark.slow
def test_sampled_exact_mode_matches_target_distribution():
    _, tgt, prompt, joint = peaky_case()
    # a sampling draft model close to the target (accepts often) -> draft_probs are used
    drafter = DraftModelDrafter(_peaky(5, noise=0.02), k=2)
    p, tv, acc = _chi2(tgt, drafter, prompt, joint, 600, "exact")
    print(f"draft model, exact: chi2 p={p:.3f} TV={tv:.3f} accepted/step={acc:.2f}")
    assert p > 0.01 and acc > 0.2
    # deterministic proposals (prompt lookup, draft_probs=None)
    p, tv, acc = _chi2(tgt, PromptLookupDrafter(), prompt, joint, 300, "exact", seed=1)
    print(f"prompt lookup, exact: chi2 p={p:.3f} TV={tv:.3f} accepted/step={acc:.2f}")
    assert p > 0.01 and acc > 0.1
    # negative control: typical acceptance is not distribution-preserving, and this test sees it
    p, tv, acc = _chi2(tgt, drafter, prompt, joint, 300, "typical", seed=2)
    print(f"draft model, typical (negative control): chi2 p={p:.2e} TV={tv:.3f}")
    assert p < 1e-3
