"""Fast drafting: the preallocated draft KV cache drafts exactly what a growing/cropped DynamicCache drafts, and
the cache itself appends, grows and rolls back like a fresh prefill."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from draftheads.eval.draft_cache import DraftKVCache
from draftheads.eval.eagle3_drafter import Eagle3Drafter
from draftheads.eval.eagle_drafter import EagleDrafter, EagleTreeConfig
from draftheads.eval.generate import NoDrafter, generate, keep_cache_positions
from draftheads.heads.eagle import EagleDraft, eagle_config_for
from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for
from draftheads.heads.target import from_model

TREES = [EagleTreeConfig(top_k=4, depth=5, nodes=20), EagleTreeConfig(kind="chain", depth=4),
         EagleTreeConfig(kind="static", paths=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])]


def _reference(cls):
    """The drafter on the old storage: a transformers DynamicCache grown by cat and cut back by index_select."""

    class Ref(cls):
        def _new_cache(self, prompt_len: int):
            from transformers import DynamicCache

            return DynamicCache(config=self.draft.layer_config)

        def _rollback(self) -> None:
            keep_cache_positions(self.cache, torch.arange(self.committed))

    return Ref


def _drafts(kind: str, family: str):
    tgt = from_model(tiny_model(kind, vocab_size=128, seed=3))
    torch.manual_seed(0)
    if family == "eagle":
        d = EagleDraft(eagle_config_for(tgt), tgt)
        cls = EagleDrafter
    else:
        d = Eagle3Draft(eagle3_config_for(tgt, [1, 2, 3], 60), tgt)
        d.set_vocab(torch.randperm(128, generator=torch.Generator().manual_seed(0))[:60])
        cls = Eagle3Drafter
    for p in d.parameters():
        p.data.normal_(0, 0.3) if p.ndim == 2 else p.data.uniform_(0.5, 1.5)
    return tgt, d, cls


def _record(drafter):
    """Wrap propose/_children so every proposed tree and every frontier's top-k log-probs are kept."""
    trees, lps = [], []
    propose, children = drafter.propose, drafter._children

    def rec_propose(*a):
        trees.append(propose(*a))
        return trees[-1]

    def rec_children(*a):
        out = children(*a)
        lps.append(out[1])
        return out

    drafter.propose, drafter._children = rec_propose, rec_children
    return trees, lps


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_preallocated_cache_drafts_exactly_what_the_dynamic_cache_drafts(kind, family):
    tgt, d, cls = _drafts(kind, family)
    for tc in TREES:
        fast, ref = cls(d, tc), _reference(cls)(d, tc)
        got, want = _record(fast), _record(ref)
        for prompt in ([1, 2, 3, 4, 5], list(range(10, 40))):
            plain = generate(tgt, NoDrafter(), prompt, 24).tokens
            a, b = generate(tgt, fast, prompt, 24), generate(tgt, ref, prompt, 24)
            assert a.tokens == b.tokens == plain and a.accepted == b.accepted
            assert fast.committed == ref.committed
            torch.testing.assert_close(fast.cache.layers[0].keys, ref.cache.layers[0].keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(fast.cache.layers[0].values, ref.cache.layers[0].values, rtol=1e-5, atol=1e-6)
        assert len(got[0]) == len(want[0]) > 10
        for x, y in zip(got[0], want[0]):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.parents, y.parents)
            assert torch.equal(x.mask, y.mask) and torch.equal(x.depths, y.depths)
        for x, y in zip(got[1], want[1]):  # the dynamic tree's top-k log-probs, frontier by frontier
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_draft_kv_cache_appends_grows_and_rolls_back():
    c = DraftKVCache(capacity=4)
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(1, 2, n, 3, generator=g) for n in (3, 2, 5)]
    vs = [k + 1 for k in ks]
    k, v = c.update(ks[0], vs[0], 0)
    assert c.length == 3 and torch.equal(k, ks[0]) and torch.equal(v, vs[0])
    k, v = c.update(ks[1], vs[1], 0)  # grows past the capacity of 4, keeping the filled part
    assert c.capacity >= 5 and torch.equal(k, torch.cat(ks[:2], dim=2)) and torch.equal(v, torch.cat(vs[:2], dim=2))
    c.crop(3)  # roll back the second append
    k, v = c.update(ks[2], vs[2], 0)
    assert c.length == 8 and torch.equal(k, torch.cat([ks[0], ks[2]], dim=2))
    assert torch.equal(c.layers[0].values, torch.cat([vs[0], vs[2]], dim=2))
    with pytest.raises(ValueError, match="cannot crop a draft cache of 8 entries to 9"):
        c.crop(9)


def test_screened_topk_finds_the_exact_top_k_with_log_probs():
    """int8 screening + exact rescoring returns the exact top-k ids in the exact order, log-probs within 0.02."""
    from draftheads.eval.draft_logits import ScreenedTopK

    g = torch.Generator().manual_seed(0)
    V, H = 8000, 64
    w = torch.randn(V, H, generator=g) * torch.rand(V, 1, generator=g)  # rows of unequal norm
    x = torch.randn(32, H, generator=g) * 3
    ids, lp = ScreenedTopK(w, shortlist=32).topk(x, 10)
    ref = torch.log_softmax(torch.nn.functional.linear(x, w), dim=-1).topk(10, dim=-1)
    assert torch.equal(ids, ref.indices)
    assert (lp - ref.values).abs().max() < 0.02
    # bf16 weights (what eval drafts with): the same top values (bf16 ties may swap equal-valued ids)
    wb, xb = w.bfloat16(), x.bfloat16()
    raw = ScreenedTopK(wb).topk(xb, 5, logprobs=False)[1]  # rescored in fp32
    torch.testing.assert_close(raw, torch.nn.functional.linear(xb.float(), wb.float()).topk(5, dim=-1).values)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_screened_drafting_proposes_the_exact_trees(family):
    """The screened path (forced on for an fp32 draft, with a short shortlist) drafts the exact path's trees."""
    tgt, d, cls = _drafts("llama", family)
    for tc in TREES:
        exact, screened = cls(d, tc, screen=False), cls(d, tc, screen=True)
        screened._screen.shortlist = 12
        got, want = _record(screened), _record(exact)
        prompt = list(range(10, 40))
        assert generate(tgt, screened, prompt, 20).tokens == generate(tgt, exact, prompt, 20).tokens
        assert len(got[0]) == len(want[0])
        for x, y in zip(got[0], want[0]):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.parents, y.parents)
        # log-probs: the normalizer mixes exact shortlist logits with screened ones; on these flat 60-128-token
        # distributions the tail's int8 error shows (on SmolLM2's 49k vocabulary it is within bf16's own error)
        for x, y in zip(got[1], want[1]):
            torch.testing.assert_close(x, y, rtol=0, atol=0.35)


def test_screened_medusa_drafts_the_exact_candidates():
    from draftheads.eval.drafters import MedusaDrafter
    from draftheads.eval.trees import default_tree
    from draftheads.heads.medusa import MedusaHeads, medusa_config_for

    tgt = from_model(tiny_model("llama", vocab_size=400, seed=3))
    for share in (True, False):
        torch.manual_seed(0)
        heads = MedusaHeads(medusa_config_for(tgt, 3, 1, share), tgt.lm_head())
        for p in heads.blocks.parameters():
            p.data.normal_(0, 0.3)
        tree = default_tree(3, 16)
        exact, screened = MedusaDrafter(heads, tree, screen=False), MedusaDrafter(heads, tree, screen=True)
        for s in screened._screens:
            s.shortlist = 16
        hs = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
        for h in hs:
            exact.h = screened.h = h
            assert torch.equal(screened.propose(5, None, None).tokens, exact.propose(5, None, None).tokens)


def test_verification_reads_lm_head_rows_lazily_and_they_equal_the_full_pass():
    from draftheads.eval.generate import LazyLogitRows, first_choice_chain, tree_forward
    from draftheads.heads.target import softcap
    from draftheads.eval.trees import ancestor_mask, depths_of

    tgt = from_model(tiny_model("llama", vocab_size=128, seed=3))
    prompt = torch.tensor([[5, 9, 13, 17, 21, 25]])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.tensor([30, 31, 32, 33, 34, 35, 36])
    assert first_choice_chain(parents) == [0, 1, 3, 6]
    outs = []
    for logits in (True, False):
        cache = tgt.new_cache()
        tgt(prompt, cache=cache, logits=False)
        outs.append(tree_forward(tgt, tokens, ancestor_mask(parents), depths_of(parents), 6, cache, logits=logits))
    full, lazy_out = outs
    assert lazy_out["logits"] is None
    lazy = LazyLogitRows(lazy_out["last_hidden"][0], tgt.lm_head(), first_choice_chain(parents))
    assert lazy.computed == 4 and lazy.shape == full["logits"][0].shape
    for i in (0, 3, 6):
        torch.testing.assert_close(lazy[i], full["logits"][0, i], rtol=1e-5, atol=1e-5)
    assert lazy.computed == 4  # prefetched
    torch.testing.assert_close(lazy[5], full["logits"][0, 5], rtol=1e-5, atol=1e-5)
    assert lazy.computed == 5 and lazy.passes == 2 and lazy.seconds > 0

    # Given the tree, a row read off the prefetched chain brings its own first-choice chain in one pass; a
    # softcap (Gemma 2's final_logit_softcapping) applies to prefetched and fetched rows alike.
    assert first_choice_chain(parents, start=2) == [2, 5]
    capped = LazyLogitRows(lazy_out["last_hidden"][0], tgt.lm_head(), first_choice_chain(parents), cap=0.2,
                           parents=parents)
    want = softcap(full["logits"][0], 0.2)  # [N, V]
    assert want.abs().max() < 0.2 < full["logits"][0].abs().max()  # the cap bites
    torch.testing.assert_close(capped[3], want[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(capped[2], want[2], rtol=1e-5, atol=1e-5)
    assert capped.computed == 6 and capped.passes == 2
    torch.testing.assert_close(capped[5], want[5], rtol=1e-5, atol=1e-5)
    assert capped.computed == 6 and capped.passes == 2
