"""Speculative generation loop: greedy speculative output == plain greedy, cache compaction is exact."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from draftheads.eval.drafters import MedusaDrafter
from draftheads.eval.generate import DraftTree, NoDrafter, generate, keep_cache_positions
from draftheads.eval.trees import chain, default_tree, static_tree
from draftheads.heads.medusa import MedusaHeads, medusa_config_for
from draftheads.heads.target import from_model


class OracleDrafter:
    """Proposes the true greedy continuation in a chain (+ a wrong sibling): must accept everything."""

    layers = ()

    def __init__(self, continuation: list[int], depth: int = 4):
        self.cont, self.depth, self.pos = continuation, depth, 0

    def begin(self, prompt, hidden):
        self.pos = 1  # the root is continuation[0]

    def propose(self, root, sampling, generator):
        toks = self.cont[self.pos:self.pos + self.depth]
        n = len(toks)
        # root, a wrong sibling at depth 1 (index 1), then the true chain
        wrong = (toks[0] + 1) % 50 if toks else 0
        tokens = [root, wrong] + toks
        parents = [-1, 0] + [0] + list(range(2, 2 + n - 1))
        return DraftTree(torch.tensor(tokens[: 2 + n]), torch.tensor(parents[: 2 + n]))

    def accept(self, tree, path, nxt, hidden):
        self.pos += len(path)


def _plain_hf(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_plain_loop_matches_hf_generate():
    model = tiny_model("llama", vocab_size=128)
    tgt = from_model(model)
    prompt = [5, 9, 17, 3, 22, 8]
    res = generate(tgt, NoDrafter(), prompt, 30)
    assert res.tokens == _plain_hf(model, prompt, 30)
    assert res.tau == 1.0 and res.steps == 29


def test_oracle_chain_accepts_everything_and_matches():
    model = tiny_model("llama", vocab_size=128)
    tgt = from_model(model)
    prompt = [5, 9, 17, 3, 22, 8]
    ref = _plain_hf(model, prompt, 40)
    res = generate(tgt, OracleDrafter(ref, depth=4), prompt, 40)
    assert res.tokens == ref
    # every step accepts the full chain of 4 (except possibly the last, cut by max_new_tokens)
    assert all(a == 4 for a in res.accepted[:-1]), res.accepted
    assert res.tau > 4.5


def test_medusa_greedy_equals_plain_greedy_llama_and_qwen2():
    for kind in ("llama", "qwen2"):
        model = tiny_model(kind, vocab_size=128, seed=3)
        tgt = from_model(model)
        torch.manual_seed(0)
        heads = MedusaHeads(medusa_config_for(tgt, 3, 1, False), tgt.lm_head())
        for p in heads.parameters():  # random (untrained) heads: wrong guesses exercise rejection + compaction
            p.data.normal_(0, 0.5)
        drafter = MedusaDrafter(heads, default_tree(3, 20))
        for prompt in ([1, 2, 3, 4, 5], [7, 7, 7, 7], list(range(10, 40))):
            ref = _plain_hf(model, prompt, 48)
            res = generate(tgt, drafter, prompt, 48)
            assert res.tokens == ref, (kind, prompt)


def test_eos_stops_and_is_kept():
    model = tiny_model("llama", vocab_size=128)
    tgt = from_model(model)
    prompt = [5, 9, 17, 3, 22, 8]
    ref = _plain_hf(model, prompt, 30)
    eos = ref[7]
    first = ref.index(eos)
    res = generate(tgt, OracleDrafter(ref, depth=5), prompt, 30, eos_ids=[eos])
    assert res.tokens == ref[: first + 1] and res.stopped == "eos"


def test_tree_forward_then_compaction_equals_fresh_prefill_of_accepted_path():
    """After a tree forward, keeping prefix + accepted path gives the cache of a plain prefill of those tokens."""
    from draftheads.eval.trees import ancestor_mask

    model = tiny_model("llama", vocab_size=128)
    tgt = from_model(model)
    prefix = torch.tensor([[4, 8, 15, 16, 23]])
    tree = static_tree([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)])
    tokens = torch.tensor([42, 7, 9, 11, 3, 5, 77])  # root + 6 nodes
    P, N = prefix.shape[1], tokens.numel()
    cache = tgt.new_cache()
    tgt(prefix, cache=cache)
    mask = torch.ones(N, P + N, dtype=torch.bool)
    mask[:, P:] = ancestor_mask(tree.parents)
    tgt(tokens[None], cache=cache, attention_mask=mask[None, None], position_ids=(P + tree.depths)[None])
    path = [0, 2, 4, 6]  # root -> (1,) -> (1,0) -> (1,0,0)
    assert tree.parents[6] == 4 and tree.parents[4] == 2 and tree.parents[2] == 0
    keep_cache_positions(cache, torch.cat([torch.arange(P), P + torch.tensor(path)]))
    fresh = tgt.new_cache()
    tgt(torch.cat([prefix[0], tokens[path]])[None], cache=fresh)
    assert cache.get_seq_length() == P + len(path)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


def test_static_tree_structure():
    t = static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.max_rank() == [2, 2, 1]
    c = chain(3)
    assert c.parents.tolist() == [-1, 0, 1, 2]


def test_tree_from_accuracies_is_optimal_and_handles_zero_profiles():
    from draftheads.eval.trees import expected_accept_length, tree_from_accuracies

    acc = [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    t = tree_from_accuracies(acc, 4)  # root + 3 best prefix-closed nodes: (0,), (0,0)=.2, (1,)=.2 -> tie by path
    assert t.size == 4 and (0,) in t.paths and (0, 0) in t.paths
    assert expected_accept_length(t, acc) == pytest.approx(1 + 0.5 + 0.2 + 0.2)
    assert tree_from_accuracies([[0.0] * 3] * 2, 5).size == 5  # an untrained profile still yields a tree
