"""Chunked vocabulary-sized losses (train/losses.py): every family's loss, metrics and gradients are those of the
plain [n, V] computation, whether the logits come in one chunk or in many (checkpointed) chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from draftheads.heads.target import from_model
import draftheads.train.losses as losses

V = 128


@pytest.fixture(scope="module")
def target():
    return from_model(tiny_model("llama", vocab_size=V, seed=3))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, 24), generator=g)
    att = torch.ones_like(ids)
    att[1, 20:] = 0
    lm = (torch.rand(2, 24, generator=g) < 0.7).long()
    return {"input_ids": ids, "attention_mask": att, "loss_mask": lm}


def _grads(objective, batch, elements, monkeypatch):
    """(loss, stats, grads) with CHUNK_ELEMENTS = elements (one big chunk, or several of a few rows)."""
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", elements)
    objective.zero_grad(set_to_none=True)
    loss, stats = objective(batch)
    loss.backward()
    params = [p for p in objective.parameters() if p.requires_grad]
    return loss.detach(), {k: (float(s), float(c)) for k, (s, c) in stats.items()}, \
        [p.grad.clone() for p in params]


def _same(a, b):
    la, sa, ga = a
    lb, sb, gb = b
    assert la.item() == pytest.approx(lb.item(), rel=1e-5)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k][1] == sb[k][1] and sa[k][0] == pytest.approx(sb[k][0], rel=1e-5, abs=1e-5), k
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()) + 1e-12)


def _several(vocab):
    return 5 * vocab  # 5 rows per chunk: every loss here spans several chunks


def test_medusa_chunks_equal_the_plain_loss(target, batch, monkeypatch):
    from draftheads.heads.medusa import MedusaHeads, medusa_config_for
    import draftheads.train.medusa as train_medusa
    from draftheads.train.medusa import MedusaObjective

    torch.manual_seed(0)
    for share in (True, False):
        heads = MedusaHeads(medusa_config_for(target, 3, 1, share), target.lm_head())
        for blk in heads.blocks:  # away from the identity init, so heads differ
            torch.nn.init.normal_(blk[0].linear.weight, std=0.1)
        obj = MedusaObjective(heads, target)
        one = _grads(obj, batch, 1 << 30, monkeypatch)
        _same(_grads(obj, batch, _several(V), monkeypatch), one)
        if share:  # fused through the shared lm_head; the checkpointed chunks give the same numbers
            with monkeypatch.context() as m:
                m.setattr(train_medusa, "linear_cross_entropy", lambda *a, **k: None)
                _same(_grads(obj, batch, _several(V), monkeypatch), one)
        # the plain computation: [n, V] logits per head, as the objective computed them before chunking
        hidden = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        logits=False)["last_hidden"]
        ref = 0.0
        for k in range(1, 4):
            h, labels = obj._head_inputs(batch, hidden, k)
            ref = ref + 0.8 ** k * F.cross_entropy(heads.project(k - 1, heads.head_hidden(k - 1, h)).float(), labels,
                                                   reduction="sum")
        g = torch.autograd.grad(ref, [p for p in obj.parameters() if p.requires_grad])
        _same(one, (ref.detach(), one[1], list(g)))


def test_eagle_chunks_equal_the_plain_loss(target, batch, monkeypatch):
    from draftheads.heads.eagle import EagleDraft, eagle_config_for
    from draftheads.train.eagle import EagleObjective

    import draftheads.train.eagle as train_eagle

    torch.manual_seed(0)
    obj = EagleObjective(EagleDraft(eagle_config_for(target), target), target, noise="none")
    one = _grads(obj, batch, 1 << 30, monkeypatch)  # the fused loss through the frozen lm_head
    _same(_grads(obj, batch, _several(V), monkeypatch), one)
    with monkeypatch.context() as m:  # the checkpointed chunks a sharded lm_head falls back to: the same numbers
        m.setattr(train_eagle, "linear_cross_entropy", lambda *a, **k: None)
        _same(_grads(obj, batch, _several(V), monkeypatch), one)
    # the plain computation: log_softmax over [n, V] draft logits against the target's full softmax
    hidden = {l: h for l, h in target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      layers=obj.layers, logits=False)["hidden"].items()}
    p, tf, tl, _ = obj.predict(batch, hidden, noise=False)
    feat = F.smooth_l1_loss(p.float(), tf.float(), reduction="none").mean(-1).sum()
    tprob = torch.softmax(target.lm_head()(tl).float(), -1)
    ce = -(tprob * torch.log_softmax(obj.draft.logits(p).float(), -1)).sum()
    ref = obj.w_feat * feat + obj.w_tok * ce
    g = torch.autograd.grad(ref, [q for q in obj.parameters() if q.requires_grad])
    assert one[1]["ce"][0] == pytest.approx(ce.item(), rel=1e-5)
    _same(one, (ref.detach(), one[1], list(g)))


def test_eagle3_chunks_equal_one_chunk(target, batch, monkeypatch):
    from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for
    from draftheads.train.eagle3 import Eagle3Objective

    torch.manual_seed(0)
    d = Eagle3Draft(eagle3_config_for(target, [1, 2, 3], 40), target)
    d.set_vocab(torch.randperm(V)[:40], init_lm_head_from=target.lm_head().weight)
    for ck in (True, False):
        obj = Eagle3Objective(d, target, ttt_steps=3, loss_checkpoint=ck)
        one = _grads(obj, batch, 1 << 30, monkeypatch)
        _same(_grads(obj, batch, _several(V), monkeypatch), one)  # also the target's [rows, V] chunks
    # target_info over full-vocabulary chunks = the distribution restricted to the draft vocabulary
    top = torch.randn(2, 7, target.hidden_size)
    info = obj.target_info(top)
    z = target.lm_head()(top)
    ids = d.target_ids()
    torch.testing.assert_close(info["probs"], torch.softmax(z[..., ids], -1))
    torch.testing.assert_close(info["mass"], torch.softmax(z, -1)[..., ids].sum(-1))
    amax = z.argmax(-1)
    assert torch.equal(info["argmax"], torch.where(d.t2d[amax], (d.t2d.long().cumsum(0) - 1)[amax], -1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an fp32 target under bf16 autocast: still its fp32 product
        info_ac = obj.target_info(top)
    torch.testing.assert_close(info_ac["probs"], info["probs"], rtol=1e-6, atol=1e-7)


def test_chunked_topk_and_empty_inputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 50)
    h = torch.randn(23, 8)
    z = lin(h)
    assert torch.equal(losses.chunked_topk(h, lin, 5, 50, elements=3 * 50), z.topk(5, -1).indices)
    assert torch.equal(losses.chunked_topk(h, lin, 1, 50, elements=3 * 50)[:, 0], z.argmax(-1))
    assert losses.chunked_topk(h[:0], lin, 5, 50).shape == (0, 5)
    assert losses.chunk_rows(262144) == losses.CHUNK_ELEMENTS // 262144 and losses.chunk_rows(10 ** 9) == 1
    # no rows: fn still runs once, so its parameters get (zero) gradients on every rank
    loss, hits = losses.chunked_sum(lambda x, y, stats: losses.cross_entropy_hits(lin(x), y, 5, stats),
                                    h[:0], torch.zeros(0, dtype=torch.long), vocab=50)
    loss.backward()
    assert loss.item() == 0 and hits.tolist() == [0, 0] and lin.weight.grad is not None


def test_fused_linear_cross_entropy_through_a_frozen_projection(monkeypatch):
    """The shared-lm_head Medusa path: loss, hit counts and grad_h equal the plain [n, V] computation, in one chunk
    and in chunks of 3 rows; a trainable projection is left to the checkpointed chunks (None)."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 50).requires_grad_(False)
    labels = torch.randint(0, 50, (23,))
    h0 = torch.randn(23, 8)
    z = proj(h0)
    ref = F.cross_entropy(z, labels, reduction="sum")
    top = z.topk(5, -1).indices
    ref_hits = [float((top[:, 0] == labels).sum()), float((top == labels[:, None]).any(-1).sum())]
    g_ref = torch.autograd.grad(F.cross_entropy(proj(h0.requires_grad_()), labels, reduction="sum") * 0.7, h0)[0]
    for elements in (1 << 30, 3 * 50):
        monkeypatch.setattr(losses, "CHUNK_ELEMENTS", elements)
        h = h0.detach().clone().requires_grad_()
        loss, hits = losses.linear_cross_entropy(h, proj, labels)
        (loss * 0.7).backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and hits.tolist() == ref_hits
        torch.testing.assert_close(h.grad, g_ref, rtol=1e-5, atol=1e-6)
    assert losses.linear_cross_entropy(h0, torch.nn.Linear(8, 50), labels) is None  # trainable weight
    with torch.no_grad():  # evaluation: no gradient is computed or kept
        loss, hits = losses.linear_cross_entropy(h0.requires_grad_(), proj, labels)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and not loss.requires_grad


def test_fused_loss_computes_in_the_frozen_weights_dtype_under_autocast():
    """bf16 autocast (train.mixed_precision on a bf16-capable CPU) around an fp32 frozen projection: the fused loss
    runs its matmuls in fp32 (no per-chunk bf16 copy of the weight), so loss and grad_h equal the fp32 ones; the
    same products in bf16 differ by > 1e-3."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 500, bias=False).requires_grad_(False)
    labels = torch.randint(0, 500, (40,))
    h0 = torch.randn(40, 64)
    h = h0.clone().requires_grad_()
    ref, _ = losses.linear_cross_entropy(h, proj, labels)
    ref.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ha = h0.clone().requires_grad_()
        loss, _ = losses.linear_cross_entropy(ha, proj, labels)
        z_bf16 = proj(h0).float()  # what autocast makes of the product
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(ha.grad, h.grad, rtol=1e-6, atol=1e-7)
    assert (z_bf16 - proj(h0)).abs().max() > 1e-3  # bf16 products differ visibly: the check can tell them apart
