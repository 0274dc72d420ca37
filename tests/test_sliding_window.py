"""Exact with sliding windows: a tiny Gemma-3 target (window 8, sliding and full layers mixed) and prompts several
windows long.

What can go wrong there: transformers' sliding-window cache layers keep only the last ``window - 1`` positions, so a
tree forward's ready [N, cur+N] mask does not fit them and a rollback to "prefix + accepted path" cannot restore what
they dropped; and a ready mask is used as it is on every layer, so a sliding layer would see keys beyond its window.
Checked here against transformers' own decoding: the tree forward's logits per node, the cache after a rejection,
fp32 greedy output of every drafter (the references are ``model.generate`` with its own sliding cache), and the exact
sampling rule through the loop (chi-square of the first tokens against the target's enumerated joint, with the
window-blind mask as a negative control that must be detected).
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
import draftheads.eval.tree_masks as tree_masks_mod
from draftheads.eval.drafters import build_drafter
from draftheads.eval.exactness import chi2_tv
from draftheads.eval.generate import DraftTree, attention_windows, commit_tree_path, generate, tree_forward
from draftheads.eval.trees import ancestor_mask, depths_of
from draftheads.eval.verify import apply_sampling
from draftheads.heads.target import FrozenTarget, from_model

W = 8  # sliding window
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = ("medusa", "eagle", "eagle3", "block")
TREES = {"medusa": {"size": 12, "max_depth": 3}, "eagle": {"top_k": 3, "depth": 4, "nodes": 10},
         "eagle3": {"top_k": 3, "depth": 4, "nodes": 10}, "block": {"kind": "chain", "depth": 5}}

pytestmark = pytest.mark.usefixtures("one_thread")


def gemma3_model(vocab_size: int = 96, seed: int = 0, peak: float = 8.0, hidden: int = 32):
    """A random Gemma-3 text model; ``peak`` scales the final norm so greedy continuations are not ties of a flat
    distribution (Gemma norms compute x·(1 + w), w starts at 0)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, max_position_embeddings=512, sliding_window=W, layer_types=LAYER_TYPES,
                           pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(peak - 1.0)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def save_head(family: str, tgt: FrozenTarget, out: Path, scale: float = 0.3) -> Path:
    """An untrained head with random weights for ``tgt``, saved as training saves it."""
    torch.manual_seed(1)
    V = tgt.vocab_size
    if family == "medusa":
        from draftheads.heads.medusa import MedusaHeads, medusa_config_for

        head: Any = MedusaHeads(medusa_config_for(tgt, 3, 1, False), tgt.lm_head())
    elif family == "eagle":
        from draftheads.heads.eagle import EagleDraft, eagle_config_for

        head = EagleDraft(eagle_config_for(tgt), tgt)
    elif family == "block":
        from draftheads.heads.block import BlockDraft, block_config_for

        L = tgt.num_layers
        head = BlockDraft(block_config_for(tgt, sorted({0, L // 2, L - 1}), 2, 6, "kv"), tgt)
    else:
        from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for

        head = Eagle3Draft(eagle3_config_for(tgt, [1, 2, 3], V - 1), tgt)
        head.set_vocab(torch.arange(1, V), init_lm_head_from=tgt.lm_head().weight)  # no draft of token 0
    for p in head.parameters():
        p.data.normal_(0, scale) if p.ndim == 2 else p.data.uniform_(0.5, 1.5)
    head.save_pretrained(out, tgt.identity)
    return out


class NoisyOracle:
    """Drafts the true greedy continuation ``depth`` deep — behind a wrong first sibling (so the accepted path is not a
    prefix of the node order and the cache commit moves entries), with every third step's chain wrong from depth 2 on
    (a rejection in the middle of the chain). Depth > window: tree keys fall out of a sliding layer's window too."""

    layers = ()

    def __init__(self, continuation: list[int], depth: int, vocab: int):
        self.cont, self.depth, self.vocab, self.pos, self.step = continuation, depth, vocab, 0, 0

    def begin(self, prompt, hidden):
        self.pos, self.step = 1, 0

    def propose(self, root, sampling, generator) -> DraftTree:
        true = self.cont[self.pos: self.pos + self.depth]
        self.step += 1
        if not true:
            return DraftTree(torch.tensor([root]), torch.tensor([-1]))
        chain = list(true)
        if self.step % 3 == 0 and len(chain) > 2:
            chain[2] = (chain[2] + 1) % self.vocab
        tokens = [root, (true[0] + 1) % self.vocab] + chain
        parents = [-1, 0, 0] + list(range(2, 2 + len(chain) - 1))
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))

    def accept(self, tree, path, nxt, hidden):
        self.pos += len(path)


@pytest.fixture(scope="module")
def model():
    return gemma3_model()


@pytest.fixture(scope="module")
def target(model) -> FrozenTarget:
    return from_model(model)


def prompts(vocab: int) -> list[list[int]]:
    """Five windows of mixed tokens, and a repetitive one (prompt lookup finds its n-grams)."""
    g = torch.Generator().manual_seed(7)
    mixed = torch.randint(3, vocab, (5 * W,), generator=g).tolist()
    return [mixed, ([11, 12, 13, 14, 15, 16] * 7)[: 5 * W - 2]]


def test_attention_windows_read_the_layer_types(target):
    assert attention_windows(target.config) == {"sliding_attention": W, "full_attention": None}
    from transformers import LlamaConfig, MistralConfig

    assert attention_windows(LlamaConfig()) == {"full_attention": None}
    assert attention_windows(MistralConfig(sliding_window=16)) == {"sliding_attention": 16}  # every layer slides


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_forward_equals_plain_forwards_and_the_cache_commit_a_fresh_prefill(impl):
    """Each node's logits from one tree forward on top of 3 windows of cache equal the model's own forward of
    prefix + that node's path (no cache, transformers' masks), for a chain deeper than the window; committing a path
    that is not a prefix of the node order leaves the cache of a fresh prefill of the accepted tokens. Both attention
    implementations a target may use (eager adds its mask to the scores: a bool tree mask there masked nothing)."""
    model = gemma3_model()
    model.set_attn_implementation(impl)
    target = from_model(model)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 96, (3 * W,), generator=g)
    P = prefix.numel()
    # root; a wrong branch (1) with a child; the main chain 3..3+W+2 (depth W+2 > W) hanging off node 2
    parents = torch.tensor([-1, 0, 0, 1] + [2] + list(range(4, 4 + W + 1)))
    tokens = torch.randint(3, 96, (parents.numel(),), generator=g)
    cache = target.new_cache()
    target(prefix[None], cache=cache, logits=False)
    out = tree_forward(target, tokens, ancestor_mask(parents), depths_of(parents), P, cache)
    logits = out["logits"][0]  # [N, V]

    def path_to(i: int) -> list[int]:
        p = [i]
        while parents[p[-1]] >= 0:
            p.append(int(parents[p[-1]]))
        return p[::-1]

    with torch.no_grad():
        for i in range(tokens.numel()):
            ref = model(torch.cat([prefix, tokens[path_to(i)]])[None]).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, rtol=1e-4, atol=1e-4, msg=f"node {i}")
    path = path_to(tokens.numel() - 2)  # root, 2, 4, 5, ...: skips the wrong branch's entries
    commit_tree_path(cache, P, path)
    fresh = target.new_cache()
    target(torch.cat([prefix, tokens[path]])[None], cache=fresh, logits=False)
    assert cache.get_seq_length() == fresh.get_seq_length() == P + len(path)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, Any]:
    """Every family's drafter built by eval's factory from a saved checkpoint, and prompt lookup."""
    out = {}
    for family in FAMILIES:
        head = save_head(family, target, tmp_path_factory.mktemp(f"sw-{family}"))
        out[family], desc = build_drafter("auto", target, str(head), OmegaConf.create(TREES[family]), target.dtype)
        assert desc["drafter"] == family
    out["prompt_lookup"], _ = build_drafter("prompt_lookup", target, None, OmegaConf.create({}), target.dtype,
                                            baselines={"lookup_tokens": 6})
    return out


def _check_greedy(model, target, drafters, prompt: list[int], n: int) -> None:
    ref = hf_greedy(model, prompt, n)
    for name, drafter in drafters.items():
        res = generate(target, drafter, prompt, n)
        assert res.tokens == ref, (name, prompt[:4])
    res = generate(target, NoisyOracle(ref, W + 2, target.vocab_size), prompt, n)
    assert res.tokens == ref
    assert max(res.accepted) == W + 2 and any(0 < a < W + 2 for a in res.accepted), res.accepted


def test_greedy_equals_transformers_generate_for_every_drafter(model, target, drafters):
    """fp32 greedy identity over 24 new tokens after a prompt of five windows, for every family's drafter, prompt
    lookup and a noisy oracle (accepts through a moved path, rejections mid-chain, a tree deeper than the window)."""
    _check_greedy(model, target, drafters, prompts(target.vocab_size)[0], 24)


@pytest.mark.slow
def test_greedy_equals_transformers_generate_longer_and_other_trees(model, target, drafters, tmp_path):
    """Slow: 96 new tokens (twelve windows) after both prompts; EAGLE-3 on its static and chain trees as well."""
    head = save_head("eagle3", target, tmp_path / "e3")
    more = dict(drafters)
    for kind in ("static", "chain"):
        more[f"eagle3-{kind}"], _ = build_drafter("auto", target, str(head), OmegaConf.create(
            {"kind": kind, "depth": 4, "nodes": 10}), target.dtype)
    for prompt in prompts(target.vocab_size):
        _check_greedy(model, target, more, prompt, 96)


# ------------------------------------------------------------------------------------- the exact rule, sampled

V = 4  # the joint of the first k tokens has V**k cells
SAMPLING = {"temperature": 0.9, "top_p": 1.0, "top_k": 2}
ALPHA, TV_FACTOR = 1e-3, 3.0  # eval/exactness.py's defaults for "consistent with the target"
SMALL_TREES = {"medusa": {"size": 5, "max_depth": 2}, "eagle": {"top_k": 2, "depth": 2, "nodes": 4},
               "eagle3": {"top_k": 2, "depth": 2, "nodes": 4}, "block": {"kind": "chain", "depth": 2}}


@pytest.fixture(scope="module")
def small() -> tuple[FrozenTarget, list[int]]:
    """A V=4 Gemma-3 whose next token depends on what lies beyond the window (the window-blind mask is detected),
    and a prompt of three windows."""
    tgt = from_model(gemma3_model(vocab_size=V, seed=5, peak=6.0, hidden=32))
    prompt = torch.randint(0, V, (3 * W,), generator=torch.Generator().manual_seed(2)).tolist()
    return tgt, prompt


@torch.no_grad()
def target_joint(tgt: FrozenTarget, prompt: list[int], k: int) -> np.ndarray:
    """Exact joint [V]*k of the first k tokens after ``prompt`` under SAMPLING (transformers' own forward and
    masks: one batch of every (k-1)-token continuation)."""
    prefixes = list(itertools.product(range(V), repeat=k - 1))
    logits = tgt.model(torch.tensor([prompt + list(s) for s in prefixes])).logits.double()  # [V^(k-1), T, V]
    probs = apply_sampling(logits, SAMPLING["temperature"], SAMPLING["top_p"], SAMPLING["top_k"]).numpy()
    P, joint = len(prompt), np.zeros([V] * k)
    for row, s in enumerate(prefixes):
        head = np.prod([probs[row, P - 1 + j, t] for j, t in enumerate(s)]) if s else 1.0
        joint[s] = head * probs[row, P + k - 2]
    assert abs(joint.sum() - 1.0) < 1e-9
    return joint


def sample_fit(tgt: FrozenTarget, drafter: Any, prompt: list[int], joint: np.ndarray, runs: int, seed: int,
               ) -> tuple[dict[str, Any], list[int]]:
    """chi2_tv of the first k tokens of ``runs`` seeded generate() calls against ``joint`` (plus how many runs emitted
    a sequence the target cannot: must be 0); (accepted drafts, tree depth) per verification step."""
    k = joint.ndim
    gen = torch.Generator().manual_seed(seed)
    counts, steps = np.zeros([V] * k, dtype=np.int64), []
    for _ in range(runs):
        res = generate(tgt, drafter, prompt, k, mode="exact", sampling=SAMPLING, generator=gen)
        counts[tuple(res.tokens[:k])] += 1
        steps += list(zip(res.accepted, res.tree_depths))
    st = chi2_tv(counts[joint > 0], joint[joint > 0])
    return {**st, "impossible": int(counts[joint == 0].sum())}, steps


def consistent(st: dict[str, Any]) -> bool:
    return st["impossible"] == 0 and st["p_value"] > ALPHA and st["tv"] <= TV_FACTOR * st["tv_null"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_rule_samples_the_target_distribution_beyond_the_window(family, small, tmp_path, monkeypatch):
    """1000 runs: the joint of the first 3 tokens (two verification steps on top of three windows) is the target's;
    the same loop with a window-blind tree mask (every layer sees the whole prefix) is detected."""
    tgt, prompt = small
    head = save_head(family, tgt, tmp_path / "head", scale=0.5)
    drafter, _ = build_drafter("auto", tgt, str(head), OmegaConf.create(SMALL_TREES[family]), tgt.dtype)
    joint = target_joint(tgt, prompt, 3)
    st, steps = sample_fit(tgt, drafter, prompt, joint, 1000, seed=1)
    assert consistent(st), (family, st)
    assert any(a > 0 for a, _ in steps) and any(a < d for a, d in steps), steps  # accepts and rejections ran
    monkeypatch.setattr(tree_masks_mod, "windowed", lambda full, depths, cur, window: full)
    st, _ = sample_fit(tgt, drafter, prompt, joint, 1000, seed=1)
    assert not consistent(st) and st["p_value"] < 1e-6, (family, "window-blind", st)


@pytest.mark.slow
def test_exact_rule_with_a_final_logit_softcap(tmp_path, monkeypatch):
    """Gemma 2's ``final_logit_softcapping`` (cap·tanh(logits/cap)) changes the sampled distribution, so every row the
    rule reads must carry it, the tree's prefetched rows as well as those read later; a cap that bites (0.5 on logits
    of about one unit, all four tokens sampled) turns an uncapped row into a detectably different distribution."""
    monkeypatch.setitem(globals(), "SAMPLING", {"temperature": 1.0, "top_p": 1.0, "top_k": 0})
    model = gemma3_model(vocab_size=V, seed=5, peak=6.0, hidden=32)
    model.config.final_logit_softcapping = 0.5
    tgt = from_model(model)
    assert tgt.logit_softcap == 0.5
    prompt = torch.randint(0, V, (3 * W,), generator=torch.Generator().manual_seed(2)).tolist()
    head = save_head("eagle3", tgt, tmp_path / "head", scale=0.5)
    drafter, _ = build_drafter("auto", tgt, str(head), OmegaConf.create(SMALL_TREES["eagle3"]), tgt.dtype)
    joint = target_joint(tgt, prompt, 3)  # transformers' own forward, which applies the cap
    st, steps = sample_fit(tgt, drafter, prompt, joint, 1000, seed=1)
    assert consistent(st), st
    assert any(a > 0 for a, _ in steps) and any(a < d for a, d in steps), steps
