"""EAGLE-3 decoding with drafts that must be accepted: an oracle draft for a counting target, its accepted lengths
predicted step by step, the draft's KV cache after accepts and rejects equal to a fresh prefill, and a checkpoint
made for a same-shaped target with other weights refused.

The target is built to count: a one-layer Llama whose layer adds nothing (o_proj and down_proj zero), embeddings
one-hot, and an lm_head that maps token x to x+1 (mod 10) — its greedy continuation of anything is x+1, x+2, ...
The draft is built to know that: fc maps the fused feature of x (the layer-0 state, the embedding) to the state of
x+1, its MLP advances a state by one (e_y -> e_{y+1}) and its attention output is zeroed, so the state of the root
pair predicts root+1 and each tree node's output predicts its own successor. Its draft vocabulary leaves out
token 7, so every draft chain that reaches 7 is rejected there: acceptance is high, exactly predictable, and
never total. The attention's keys and values still fill the draft's cache, which the rollback check compares.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from draftheads.eval.eagle3_drafter import Eagle3Drafter
from draftheads.eval.eagle_drafter import EagleTreeConfig
from draftheads.eval.generate import NoDrafter, generate
from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for
from draftheads.heads.target import FrozenTarget, from_model

V, H, HOLE = 10, 16, 7  # vocabulary, hidden size, the one token the draft vocabulary lacks
TREES = [EagleTreeConfig(top_k=2, depth=4, nodes=8), EagleTreeConfig(kind="chain", depth=5),
         EagleTreeConfig(kind="static", depth=3, nodes=8)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _counting_oracle() -> tuple[FrozenTarget, Eagle3Draft]:
    model = tiny_model("llama", vocab_size=V, layers=1, hidden=H, seed=0)
    eye = torch.eye(H)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(eye[:V])  # token x -> e_x
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()  # the layer adds nothing: the final state of x is e_x
        model.lm_head.weight.copy_(10 * eye[[(j - 1) % V for j in range(V)]])  # logit of x+1 is the largest
    tgt = from_model(model)
    draft = Eagle3Draft(eagle3_config_for(tgt, [0], V - 1), tgt)
    vocab = [t for t in range(V) if t != HOLE]
    draft.set_vocab(vocab)
    alpha = 5.0  # gate pre-activation 4·alpha: silu(20) = 20 (to 1e-7)
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[[(x + 1) % V for x in range(V)], list(range(V))] = 1.0  # fused feature of x -> e_{x+1}
        lay = draft.layers[0]
        lay.self_attn.o_proj.weight.zero_()
        mlp = lay.mlp
        for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
            w.zero_()
        # post_attention_layernorm(e_y) = 4 e_y; unit y fires only for e_y and adds e_{y+1} - e_y
        silu = float(torch.nn.functional.silu(torch.tensor(4 * alpha)))
        for y in range(V):
            mlp.gate_proj.weight[y, y] = alpha
            mlp.up_proj.weight[y, y] = 0.25
            mlp.down_proj.weight[:, y] = (eye[(y + 1) % V] - eye[y]) / silu
        draft.lm_head.weight.zero_()
        draft.lm_head.weight[torch.arange(V - 1), torch.tensor(vocab)] = 10.0  # draft id i predicts its target id
    return tgt, draft


def _expected_accepts(root: int, depth: int, max_new: int) -> list[int]:
    """Accepted drafts per step: the chain root+1, root+2, ... is right until it reaches HOLE (the draft cannot
    say it) or the tree's depth; the target then contributes the next token itself."""
    out, emitted = [], 1  # the root came from the prefill
    while emitted < max_new:
        a = 0
        while a < depth and (root + a + 1) % V != HOLE:
            a += 1
        out.append(a)
        emitted += a + 1
        root = (root + a + 1) % V
    return out


def _fresh_cache(draft: Eagle3Draft, tgt: FrozenTarget, seq: list[int], n: int) -> DynamicCache:
    """The draft's cache after one plain prefill of the pairs (fuse(aux_t), x_{t+1}), t < n, of ``seq``."""
    aux_layers = list(draft.config.aux_layers)
    hidden = tgt(torch.tensor([seq]), layers=aux_layers, logits=False)["hidden"]
    h = draft.fuse(torch.cat([hidden[a] for a in aux_layers], -1))  # [1, T, H]
    cache = DynamicCache(config=draft.layer_config)
    with torch.no_grad():
        draft(h[:, :n], torch.tensor([seq[1:n + 1]]), torch.arange(n)[None],
              torch.ones(n, n, dtype=torch.bool).tril()[None], cache)
    return cache


@pytest.mark.parametrize("tc", TREES, ids=lambda t: t.kind)
def test_oracle_draft_is_accepted_exactly_as_predicted_and_its_cache_rolls_back(tc):
    tgt, draft = _counting_oracle()
    prompt = [3, 9, 4]
    for max_new in (6, 11, 30):  # stop after a rejection, mid-chain, and after many steps
        ref = generate(tgt, NoDrafter(), prompt, max_new).tokens
        assert ref == [(5 + i) % V for i in range(max_new)]  # the target counts on from 4
        drafter = Eagle3Drafter(draft, tc)
        res = generate(tgt, drafter, prompt, max_new)
        assert res.tokens == ref
        depth = tc.depth if tc.kind != "static" else drafter.static.max_depth
        assert res.accepted == _expected_accepts(ref[0], depth, max_new), (tc, max_new)
        assert sum(res.accepted) > 0 and any(a < depth for a in res.accepted)
        # after the last step the draft holds the prompt's pairs and every earlier step's accepted path committed
        n = drafter.committed
        assert n == len(prompt) + sum(a + 1 for a in res.accepted[:-1])
        fresh = _fresh_cache(draft, tgt, prompt + res.tokens, n).layers[0]
        got = drafter.cache.layers[0]
        assert got.keys.shape == fresh.keys.shape, (tc, max_new, got.keys.shape, fresh.keys.shape)
        torch.testing.assert_close(got.keys, fresh.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.values, fresh.values, rtol=1e-4, atol=1e-5)
    assert res.tau > 3.0  # 30 tokens: most steps accept several drafts


def test_checkpoint_for_a_same_shaped_target_with_other_weights_is_refused(tmp_path):
    """Same vocabulary, hidden size and layers, other weights: the lm_head fingerprint differs, so the EAGLE-3 head
    is refused by its loader and by eval's drafter factory, unless the mismatch is allowed."""
    from omegaconf import OmegaConf

    from draftheads.eval.drafters import build_drafter

    tgt = from_model(tiny_model("llama", vocab_size=128, layers=2, hidden=32, seed=0))
    other = from_model(tiny_model("llama", vocab_size=128, layers=2, hidden=32, seed=5))
    assert (other.vocab_size, other.hidden_size, other.num_layers) == (tgt.vocab_size, tgt.hidden_size, tgt.num_layers)
    assert other.identity.fingerprint != tgt.identity.fingerprint
    torch.manual_seed(0)
    draft = Eagle3Draft(eagle3_config_for(tgt, [0, 1], 64), tgt)
    draft.set_vocab(torch.arange(64))
    draft.save_pretrained(tmp_path / "d", tgt.identity)
    Eagle3Draft.from_pretrained(tmp_path / "d", tgt)  # its own target loads it
    with pytest.raises(ValueError, match=r"EAGLE-3 checkpoint .*d was made for target .*fingerprint .*the weights differ"):
        Eagle3Draft.from_pretrained(tmp_path / "d", other)
    tree = OmegaConf.create({"top_k": 2, "depth": 2, "nodes": 4})
    with pytest.raises(ValueError, match="the weights differ"):
        build_drafter("auto", other, str(tmp_path / "d"), tree, other.dtype)
    back = Eagle3Draft.from_pretrained(tmp_path / "d", other, allow_target_mismatch=True)
    assert torch.equal(back.fc.weight, draft.fc.weight)
    drafter, desc = build_drafter("auto", other, str(tmp_path / "d"), tree, other.dtype, allow_target_mismatch=True)
    assert desc["drafter"] == "eagle3"
