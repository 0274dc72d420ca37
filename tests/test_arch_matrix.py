"""The architecture matrix: tiny random targets of the architectures users bring, each with every family.

Per (architecture, family) cell, through the real entry points: a few training steps (the loss falls), the saved head
loads back (weights as written), fp32 greedy output through the speculative loop equals transformers' own
``generate`` on prompts three sliding windows long (and the target wrapper's logits equal the model's, the
distribution the exact rule samples), EAGLE-3's training-time test computes what its drafter computes, and the
EAGLE-3 speculators export where the format has the draft layer (other layer types must be refused with the export's
message). The outcomes are recorded in docs/architectures.json, which
scripts/arch_matrix_table.py renders as docs/architectures.md; every cell's outcome must equal the recorded one, so the
table cannot go stale and a failure is shown, never hidden.

Fast tier: gpt-oss with untrained heads of every family, greedy identity only; and the docs table is current. Slow tier:
the full matrix.
Regenerate the table: ``python scripts/arch_matrix_table.py --run`` (this module's slow cells: 2-6 min on 2 cores).
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CHATML, compose, make_tokenizer, tiny_train_overrides
from draftheads.eval.drafters import build_drafter
from draftheads.eval.generate import generate
from draftheads.heads import registry
from draftheads.heads.target import FrozenTarget, from_model, load_target
from draftheads.scripts.arch_matrix_table import (ARCHS, CHECKS, FAMILIES, JSON_PATH, MD_PATH, OUT_ENV, arch_config,
                                                  attn_implementation, render)

W = 16  # the sliding window of every architecture that has one (arch_config)
V = 400  # conftest's tokenizer
TREES = {"medusa": {"size": 12}, "eagle": {"top_k": 4, "depth": 4, "nodes": 12},
         "eagle3": {"top_k": 4, "depth": 4, "nodes": 12}, "block": {"kind": "chain", "depth": 3}}
TRAIN = {"medusa": {"head.num_heads": 3}, "eagle": {},
         "eagle3": {"head.aux_layers": "[1,2,3]", "head.draft_vocab_size": 100, "head.ttt_steps": 2},
         "block": {"head.context_layers": "[1,2,3]", "head.block_size": 4, "head.anchors": 8}}
STEPS = 12

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(arch: str, seed: int = 0, peak: float = 20.0):
    """A random model of ``arch`` (arch_config sizes); ``peak`` scales the final norm so the next-token distribution
    is peaked (a random target's is nearly flat, which leaves a distillation loss nothing to learn and greedy
    decoding near ties). Gemma norms compute x·(1 + w) with w = 0 at init; the others x·w with w = 1."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(arch), attn_implementation=attn_implementation(arch)).eval()
    with torch.no_grad():
        w = model.model.norm.weight
        w.fill_(peak - 1.0) if bool((w == 0).all()) else w.mul_(peak)
    return model


def save_target(arch: str, out: Path) -> Path:
    tiny_model(arch).save_pretrained(out)
    make_tokenizer(CHATML).save_pretrained(out)
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, V, (3 * W,), generator=g).tolist(), ([40, 41, 42, 43, 44] * 10)[: 3 * W]]


def check_greedy(target: FrozenTarget, family: str, head: Path, n: int = 32, n_prompts: int = 2) -> None:
    """The wrapper's logits are the model's; speculative greedy output equals transformers' greedy output."""
    x = torch.tensor([prompts()[0]])
    with torch.no_grad():
        torch.testing.assert_close(target(x)["logits"], target.model(x).logits, rtol=1e-5, atol=1e-5)
    drafter, desc = build_drafter("auto", target, str(head), OmegaConf.create(TREES[family]), target.dtype)
    assert desc["drafter"] == family
    for prompt in prompts()[:n_prompts]:
        ref = hf_greedy(target.model, prompt, n)
        res = generate(target, drafter, prompt, n)
        assert res.tokens == ref, (family, prompt[:3], res.tokens, ref)


def check_trained_as_drafted(draft: Any, target: FrozenTarget, k: int = 3) -> None:
    """EAGLE-3's training-time test computes what the drafter computes: rollout step s at the last prompt position
    equals the chain drafter's depth-s expansion (tests/test_eagle3.py does this for Llama and Qwen2)."""
    from draftheads.eval.eagle3_drafter import Eagle3Drafter
    from draftheads.eval.eagle_drafter import EagleTreeConfig

    aux_layers = list(draft.config.aux_layers)
    prompt = torch.tensor(prompts()[0][:10])
    P = len(prompt)
    out = target(prompt[None], layers=aux_layers)
    root = int(out["logits"][0, -1].argmax())
    drafter = Eagle3Drafter(draft, EagleTreeConfig(kind="chain", depth=k))
    drafter.begin(prompt, {a: h[0] for a, h in out["hidden"].items()})
    seq = prompt.tolist() + drafter.propose(root, None, None).tokens.tolist()
    S = len(seq) - 1
    aux = torch.zeros(1, S, len(aux_layers) * target.hidden_size)
    aux[0, :P] = torch.cat([out["hidden"][a][0] for a in aux_layers], -1)
    with torch.no_grad():
        outs = draft.rollout(aux, torch.tensor([seq[1:] + [0] * (k - 1)]), torch.arange(S)[None],
                             torch.ones(S, S, dtype=torch.bool).tril()[None], k)
    for s in range(k):
        scale = float(outs[s].abs().max())
        torch.testing.assert_close(outs[s][0, P - 1], drafter._h[s], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m: f"step {s}: {m.splitlines()[0]}")


def _outcome(fn, model_type: str = "") -> str:
    """'pass'; 'unsupported: <message>' for a user error (ValueError) that names the target's model_type (a family
    refusing an architecture it cannot be built for); else 'fail: <exception type>: <first line>'. Stable text: what
    the table shows."""
    try:
        fn()
        return "pass"
    except Exception as e:  # noqa: BLE001 - every failure is recorded and compared, none is swallowed silently
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, ValueError) and model_type and repr(model_type) in first:
            return f"unsupported: {first}"
        return f"fail: {type(e).__name__}: {first[:160]}"


def run_cell(arch: str, family: str, target_dir: Path, chat_file: Path, work: Path) -> dict[str, Any]:
    """Every check of one cell; {check: outcome} plus the first and last training losses."""
    out = work / "run"
    res: dict[str, Any] = {}
    losses: list[float] = []
    impl = {"target.attn_implementation": attn_implementation(arch)}

    def train() -> None:
        kw = {"train.max_steps": STEPS, "optim.lr": 3e-3, "train.log_every": 1, **TRAIN[family], **impl}
        trainer = importlib.import_module(registry.get(family).trainer)
        trainer.main(compose(family, tiny_train_overrides(target_dir, chat_file, out, **kw)))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses.extend(r["loss"] for r in rows if "loss" in r)
        assert len(losses) == STEPS, losses
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < first, f"loss did not fall: {first:.4f} -> {last:.4f}"

    res["train"] = _outcome(train, arch_config(arch).model_type)
    final = out / "final"
    holder: dict[str, Any] = {}

    def load() -> None:
        from safetensors.torch import load_file

        target = load_target({"name": str(target_dir), "dtype": "fp32",
                              "attn_implementation": attn_implementation(arch)})
        head = registry.get(family).load("head").from_pretrained(final, target)
        saved = load_file(str(final / "model.safetensors"))
        state = head.state_dict()
        assert set(state) == set(saved), sorted(set(state) ^ set(saved))
        for k, v in state.items():
            torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
        holder.update(target=target, head=head)

    res["load"] = _outcome(load) if res["train"] == "pass" else "not run"
    ok = res["load"] == "pass"
    res["greedy"] = _outcome(lambda: check_greedy(holder["target"], family, final)) if ok else "not run"
    if family != "eagle3":
        res["ttt"] = res["export"] = "n/a"
    elif not ok:
        res["ttt"] = res["export"] = "not run"
    else:
        res["ttt"] = _outcome(lambda: check_trained_as_drafted(holder["head"], holder["target"]))
        res["export"] = _export_outcome(holder["head"], holder["target"], work / "export")
    res["loss"] = [round(losses[0], 4), round(losses[-1], 4)] if losses else None
    return res


def _export_outcome(draft: Any, target: FrozenTarget, out: Path) -> str:
    """'pass' (written and re-checked), 'refused' (the export's own message for a layer type speculators lacks), or a
    failure."""
    from draftheads.scripts.export import SPECULATORS_LAYER_TYPES, export, verify_export

    layer_type = draft.layer_config.model_type
    try:
        export(draft, target, out, "speculators", verifier="tiny", dtype=torch.float32)
        verify_export(out, draft, "speculators")
    except ValueError as e:
        if layer_type not in SPECULATORS_LAYER_TYPES and "supports EAGLE-3 draft layers of model_type" in str(e):
            return "refused"
        return f"fail: ValueError: {str(e).splitlines()[0][:160]}"
    except Exception as e:  # noqa: BLE001
        return f"fail: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if layer_type not in SPECULATORS_LAYER_TYPES:
        return f"fail: exported a {layer_type!r} draft layer, which speculators does not build"
    return "pass"


# ------------------------------------------------------------------------------------------------ the table


def recorded() -> dict[str, Any]:
    return json.loads(JSON_PATH.read_text())


@pytest.fixture(scope="module")
def new_results():
    """Outcomes of this run; written to $DRAFTHEADS_ARCH_MATRIX_OUT (merged into what is there) when it is set."""
    results: dict[str, Any] = {}
    yield results
    path = os.environ.get(OUT_ENV)
    if path and results:
        p = Path(path)
        old = json.loads(p.read_text()) if p.is_file() else {}
        for arch, fams in results.items():
            old.setdefault(arch, {}).update(fams)
        p.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


def test_docs_table_is_current():
    """docs/architectures.md is the rendering of docs/architectures.json, which covers the whole matrix."""
    data = recorded()
    cells = data["cells"]
    assert sorted(cells) == sorted(ARCHS) == sorted(data["meta"]["attention"])
    for arch in ARCHS:
        assert sorted(cells[arch]) == sorted(FAMILIES), arch
        for fam in FAMILIES:
            assert set(CHECKS) <= set(cells[arch][fam]), (arch, fam)
    assert MD_PATH.read_text() == render(data), "stale: run python scripts/arch_matrix_table.py"


def test_gpt_oss_untrained_heads_greedy_identity(tmp_path):
    """Fast: gpt-oss (mixture of experts, attention sinks, eager attention, sliding and full layers) with an
    untrained head of every family saved and built by eval's factory: the wrapper's logits and greedy identity
    through the loop. (Gemma 3's fast counterpart is tests/test_sliding_window.py.)"""
    from test_sliding_window import save_head

    target = from_model(tiny_model("gpt_oss"))
    for family in FAMILIES:
        check_greedy(target, family, save_head(family, target, tmp_path / family), n=12, n_prompts=1)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", ARCHS)
def test_cell(arch, family, chat_file, tmp_path, new_results):
    """Slow: one cell of the matrix through training, loading, the speculative loop and export."""
    target_dir = save_target(arch, tmp_path / "target")
    res = run_cell(arch, family, target_dir, chat_file, tmp_path)
    new_results.setdefault(arch, {})[family] = res
    got = {c: res[c] for c in CHECKS}
    if os.environ.get(OUT_ENV):  # regenerating the table: record, and fail only on a failure
        assert not any(v.startswith("fail") for v in got.values()), got
        return
    want = {c: recorded()["cells"][arch][family][c] for c in CHECKS}
    assert got == want, f"{arch} × {family}: {got} but docs/architectures.json records {want}; fix it, or rerun " \
                        f"python scripts/arch_matrix_table.py --run"
