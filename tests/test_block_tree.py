"""A block draft's static tree over its positions: one draft forward fills any tree (a node at depth j takes a
candidate of block position j), greedy output stays plain's while more is accepted than on the chain, each node
reports its own position's distribution, siblings are draws without replacement, and tree=auto sizes the tree
with the block's own shape (draft cost independent of the tree)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import compose, tiny_model
from draftheads.eval.block_drafter import BlockDrafter, build_block_drafter, gumbel_topk
from draftheads.eval.block_shape import SHAPE
from draftheads.eval.generate import NoDrafter, generate
from draftheads.eval.trees import static_tree
from draftheads.heads import registry
from draftheads.heads.block import BlockDraft, block_config_for
from draftheads.heads.target import from_model

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]  # three ranks at position 1, a chain to position 3


def _draft(tgt, block: int = 4, context: str = "kv", seed: int = 0) -> BlockDraft:
    torch.manual_seed(seed)
    d = BlockDraft(block_config_for(tgt, [1, 2, 3], 2, block, context), tgt)
    for p in d.parameters():
        p.data.normal_(0, 0.3) if p.ndim > 1 else p.data.uniform_(0.5, 1.5)
    return d


@pytest.mark.parametrize("context", ["prefix", "kv"])
def test_greedy_tree_equals_plain_and_accepts_more_than_its_chain(context):
    tgt = from_model(tiny_model("llama", vocab_size=6, seed=3))
    d = _draft(tgt, context=context)
    tree = static_tree(TREE)
    chain_acc, tree_acc = [], []
    for prompt in ([1, 2, 3, 4, 5], [int(x) for x in torch.randint(0, 6, (30,), generator=torch.Generator()
                                                                     .manual_seed(1))]):
        ref = generate(tgt, NoDrafter(), prompt, 40).tokens
        on_chain = generate(tgt, BlockDrafter(d, 3), prompt, 40)
        on_tree = generate(tgt, BlockDrafter(d, tree=tree), prompt, 40)
        assert on_tree.tokens == on_chain.tokens == ref, prompt
        assert max(on_tree.tree_sizes) == len(TREE) + 1
        chain_acc += on_chain.accepted
        tree_acc += on_tree.accepted
    # the tree holds the chain's paths plus siblings: more accepted per verification step
    assert np.mean(tree_acc) > np.mean(chain_acc) > 0


def test_each_node_takes_its_positions_candidates_and_reports_its_distribution():
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=3))
    d = _draft(tgt, block=5)
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0))
    hidden = tgt(ids[None], logits=False, layers=[1, 2, 3])["hidden"]
    tree = static_tree(TREE)

    def drafted(sampling=None):
        drafter = BlockDrafter(d, tree=tree)
        drafter.begin(ids, {k: v[0] for k, v in hidden.items()})
        return drafter.propose(int(ids[-1]), sampling, torch.Generator().manual_seed(0))

    chain = BlockDrafter(d, 4)  # the whole block's distributions, position by position
    chain.begin(ids, {k: v[0] for k, v in hidden.items()})
    q = chain.propose(int(ids[-1]), {"temperature": 1.0}, torch.Generator().manual_seed(0)).draft_probs[1:]  # [4, V]
    greedy = drafted()
    for i, path in enumerate(tree.paths, start=1):  # greedy: rank r at depth j is position j's r-th best token
        assert int(greedy.tokens[i]) == int(q[len(path) - 1].topk(3).indices[path[-1]])
    sampled = drafted({"temperature": 1.0})
    depths = tree.depths[1:]
    torch.testing.assert_close(sampled.draft_probs[1:], q[depths - 1])  # each node: its position's q
    kids = [[i for i in range(1, tree.size) if int(tree.parents[i]) == n] for n in range(tree.size)]
    for n, ks in enumerate(kids):  # siblings are distinct draws
        assert len({int(sampled.tokens[k]) for k in ks}) == len(ks), (n, ks)


def test_gumbel_topk_draws_one_after_another_without_replacement():
    q = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).expand(20000, 4)  # [runs, V]
    draws = gumbel_topk(q, 2, torch.Generator().manual_seed(0))  # [runs, 2]
    assert (draws[:, 0] != draws[:, 1]).all()
    p = [0.5, 0.3, 0.15, 0.05]
    pairs = [(a, b) for a, b in itertools.product(range(4), repeat=2) if a != b]
    expected = np.array([p[a] * p[b] / (1 - p[a]) for a, b in pairs]) * len(draws)
    seen = {pair: 0 for pair in pairs}
    for a, b in draws.tolist():
        seen[(a, b)] += 1
    assert chisquare([seen[x] for x in pairs], expected).pvalue > 1e-3
    # a law it must not match: the second draw independent of the first (with replacement, then renormalised)
    wrong = np.array([p[a] * p[b] for a, b in pairs])
    assert chisquare([seen[x] for x in pairs], wrong / wrong.sum() * len(draws)).pvalue < 1e-6


def test_block_shape_sizes_static_trees_or_chains_at_one_draft_cost(tmp_path):
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=3))
    _draft(tgt, block=6).save_pretrained(tmp_path / "h", tgt.identity)
    assert registry.shape_of("block") is SHAPE
    assert SHAPE.head_stats(str(tmp_path / "h"), {}, 4) == (5, None)  # positions a step drafts: block - 1
    assert SHAPE.free({"kind": "auto"}, {}) == ["size"] and SHAPE.free({"kind": "chain"}, {}) == ["depth"]
    assert SHAPE.free({"kind": "auto", "paths": [[0]]}, {}) == []
    tree: dict = {"kind": "auto"}
    SHAPE.apply_size(tree, {}, 9)  # a sweep point is a sized static tree, not the default chain
    assert tree == {"kind": "static", "size": 9}
    table = torch.tensor([[0.5, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.1, 0.0]], dtype=torch.float64)
    static = SHAPE.candidates(table, {"kind": "auto"}, 3, 5)
    assert [c.width for c in static] == list(range(2, len(static) + 2))
    assert static[0].knobs["paths"] == [[0]] and static[0].expected == pytest.approx(1.5)
    chains = SHAPE.candidates(table, {"kind": "chain"}, 3, 5)
    assert [c.knobs for c in chains] == [{"depth": 1}, {"depth": 2}, {"depth": 3}]
    assert chains[2].expected == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.3)

    class Timed:
        draft_ms = 3.0

    cost = SHAPE.draft_ms_model([Timed()], {"kind": "auto", "paths": [[0]]}, {})
    assert cost(static[0]) == cost(static[-1]) == 3.0  # one forward drafts any tree


def test_build_block_drafter_reads_kind_paths_and_size(tmp_path):
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=3))
    _draft(tgt, block=4).save_pretrained(tmp_path / "h", tgt.identity)
    head = str(tmp_path / "h")
    d, desc = build_block_drafter(tgt, head, {"kind": "chain", "depth": 6, "size": 64}, torch.float32)
    assert desc["tree_size"] == 4 and d.tree.paths == ((0,), (0, 0), (0, 0, 0))  # the chain, clipped to the block
    d, desc = build_block_drafter(tgt, head, {"kind": "auto", "depth": 6, "size": 8}, torch.float32)
    assert desc["tree_size"] == 8 and desc["tree_source"] == "generic"  # select=default: a static tree of tree.size
    d, desc = build_block_drafter(tgt, head, {"kind": "auto", "paths": TREE}, torch.float32)
    assert desc["tree_size"] == len(TREE) + 1 and desc["tree_source"] == "custom"
    d, desc = build_block_drafter(tgt, head, {"kind": "static", "size": 10}, torch.float32)
    assert desc["tree_size"] == 10 and desc["tree_depth"] <= 3 and desc["tree_source"] == "generic"
    with pytest.raises(ValueError, match=r"tree depth 4 .*proposes 1\.\.3 positions"):
        build_block_drafter(tgt, head, {"kind": "static", "paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]},
                            torch.float32)
    with pytest.raises(ValueError, match="tree rank 64 .*only 64 candidates per position"):
        build_block_drafter(tgt, head, {"kind": "static", "paths": [[i] for i in range(65)]}, torch.float32)
    with pytest.raises(ValueError, match="tree.kind='dynamic'"):
        build_block_drafter(tgt, head, {"kind": "dynamic"}, torch.float32)
    with pytest.raises(ValueError, match="tree.paths gives a static tree"):
        build_block_drafter(tgt, head, {"kind": "chain", "paths": [[0]]}, torch.float32)


@pytest.mark.slow
def test_acceptance_job_chooses_a_tree_over_block_positions(tiny_target_dir, chat_file, tmp_path, cache_env):
    from draftheads.eval.acceptance import main
    from draftheads.heads.target import load_target
    from test_autotree import _eval_overrides

    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})
    torch.manual_seed(0)
    BlockDraft(block_config_for(tgt, [0, 1], 1, 5, "kv"), tgt).save_pretrained(tmp_path / "h", tgt.identity)
    res = main(compose("eval", _eval_overrides(tiny_target_dir, chat_file, tmp_path, "drafter=block",
                                               f"checkpoint={tmp_path / 'h'}", "tree.lookup_branch=0")))
    c = res["tree_choice"]
    assert c["free"] == ["size"] and len(c["table"]) == 4  # block 5: four positions drafted
    assert [t.get("probe") or t.get("plain") for t in c["timings"]] == [True, True]  # only the probe is timed
    assert res["drafter"]["tree_size"] == c["chosen"]["size"] == len(c["paths"]) + 1
    assert max(len(p) for p in c["paths"]) <= 4
    assert res["greedy_identical"]["identical"] == res["greedy_identical"]["turns"] == 3


def test_recorded_rank_accuracies_tune_the_blocks_tree_and_the_autotree_prior(tmp_path):
    """A checkpoint's per-position rank accuracies (training records them on held-out greedy paths) shape the
    default tree, as Medusa's do: a position-1 rank that hits more gets its node first; tree.tuned=false ignores
    them."""
    tgt = from_model(tiny_model("llama", vocab_size=64, seed=3))
    acc = [[0.1, 0.6, 0.05, 0.0], [0.5, 0.1, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]]
    _draft(tgt, block=4).save_pretrained(tmp_path / "h", tgt.identity, {"rank_accuracy": acc})
    head = str(tmp_path / "h")
    assert SHAPE.head_stats(head, {}, 9) == (3, acc)
    assert SHAPE.head_stats(head, {"tuned": False}, 9) == (3, None)
    d, desc = build_block_drafter(tgt, head, {"kind": "auto", "size": 4}, torch.float32)
    # expected accepted tokens per node: [1] 0.6, [0] 0.1, [1, 0] 0.6 * 0.5 = 0.3: the best three nodes
    assert desc["tree_source"] == "tuned" and set(d.tree.paths) == {(1,), (1, 0), (0,)}
    d, desc = build_block_drafter(tgt, head, {"kind": "auto", "size": 4, "tuned": False}, torch.float32)
    assert desc["tree_source"] == "generic" and set(d.tree.paths) != {(1,), (1, 0), (0,)}
