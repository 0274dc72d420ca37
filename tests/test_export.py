"""EAGLE-3 export: the speculators and SGLang layouts, the strict key check, and a round trip through the
vLLM ``speculators`` package (its own venv: it pins transformers <= 5.19) that must reproduce our logits."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, compose, tiny_model
from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for
from draftheads.heads.target import from_model, load_target
from draftheads.scripts.export import check_export, export, required_keys, verify_export

AUX = [1, 2, 3]
SPEC_PY = Path(os.environ.get("DRAFTHEADS_SPECULATORS_PYTHON", REPO / ".venv-spec" / "bin" / "python"))
REQUIRE = "DRAFTHEADS_REQUIRE_SPECULATORS"  # set to 1 by .ci/run: the round trip must run there, not skip


def speculators_python(path: Path | None = None) -> Path:
    """The speculators environment's Python; without one, skip, or fail where the round trip is required (CI: it is
    the only check of the export format by an independent reader, so a CI without it must not pass)."""
    path = SPEC_PY if path is None else path
    if path.is_file():
        return path
    why = (f"no speculators environment at {path} (create it with scripts/make_speculators_venv.sh, or set "
           f"DRAFTHEADS_SPECULATORS_PYTHON)")
    if os.environ.get(REQUIRE, "").strip() not in ("", "0"):
        pytest.fail(f"{why}; {REQUIRE}={os.environ[REQUIRE]} requires the speculators round trip")
    pytest.skip(why)


SPECULATORS_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d",
    "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight"}


def _draft(tgt, dv=100, seed=0, aux=AUX, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(eagle3_config_for(tgt, aux, dv, **kw), tgt)
    d.set_vocab(torch.randperm(tgt.vocab_size, generator=torch.Generator().manual_seed(seed))[:dv])
    for p in d.parameters():  # trained-looking weights: norms away from 1, projections well away from 0
        p.data.normal_(0, 0.2) if p.ndim == 2 else p.data.uniform_(0.5, 1.5)
    return d


def test_layouts_and_strict_checks(tmp_path, tiny_target_dir):
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    d = _draft(tgt)
    out = export(d, tgt, tmp_path / "spec", "speculators", "/path/to/verifier", 5, torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    assert set(t) == SPECULATORS_KEYS == required_keys(d, "speculators")
    assert t["fc.weight"].shape == (64, 192) and t["layers.0.self_attn.q_proj.weight"].shape == (64, 128)
    assert t["layers.0.self_attn.k_proj.weight"].shape == (32, 128) and t["lm_head.weight"].shape == (100, 64)
    assert t["embed_tokens.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64
    torch.testing.assert_close(t["embed_tokens.weight"].float(), tgt.embed_tokens().weight.bfloat16().float())
    assert torch.equal(t["d2t"], d.d2t) and torch.equal(t["t2d"], d.t2d)
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 100
    assert cfg["norm_before_residual"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    lc = cfg["transformer_layer_config"]
    assert lc["model_type"] == "llama" and lc["num_hidden_layers"] == 1 and lc["vocab_size"] == 400
    assert lc["head_dim"] == 16 and lc["num_key_value_heads"] == 2 and lc["tie_word_embeddings"] is False
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5}]
    assert sc["verifier"] == {"name_or_path": "/path/to/verifier", "architectures": ["LlamaForCausalLM"]}
    # SGLang: midlayer.*, flat Llama config, aux ids in its "output of layer i" convention (ours - 1)
    out = export(d, tgt, tmp_path / "sgl", "sglang", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    assert set(t) == {k.replace("layers.0.", "midlayer.") for k in SPECULATORS_KEYS}
    torch.testing.assert_close(t["midlayer.hidden_norm.weight"], d.layers[0].hidden_norm.weight)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 100
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert cfg["num_hidden_layers"] == 1 and cfg["rope_theta"] == 10000.0 and cfg["tie_word_embeddings"] is False
    verify_export(out, d, "sglang")
    # strict: a missing or an extra tensor, a config without model_type, a wrong shape
    good = load_file(str(tmp_path / "spec" / "model.safetensors"))
    scfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    req = required_keys(d, "speculators")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unexpected \[\]"):
        check_export({k: v for k, v in good.items() if k != "norm.weight"}, scfg, "speculators", req, "x")
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['verifier_lm_head.weight'\]"):
        check_export({**good, "verifier_lm_head.weight": good["lm_head.weight"]}, scfg, "speculators", req, "x")
    lc_no_type = {k: v for k, v in scfg["transformer_layer_config"].items() if k != "model_type"}
    with pytest.raises(ValueError, match="lacks model_type"):
        check_export(good, {**scfg, "transformer_layer_config": lc_no_type}, "speculators", req, "x")
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(99, 64\), expected \(100, 64\)"):
        check_export({**good, "lm_head.weight": good["lm_head.weight"][:99]}, scfg, "speculators", req, "x")
    with pytest.raises(ValueError, match=r"lacks required fields \['norm_before_residual'\]"):
        check_export(good, {k: v for k, v in scfg.items() if k != "norm_before_residual"}, "speculators", req, "x")
    # what a format cannot express is refused, not silently changed
    with pytest.raises(ValueError, match="sglang format has no norm_before_residual"):
        export(_draft(tgt, norm_before_residual=True), tgt, tmp_path / "x", "sglang")
    with pytest.raises(ValueError, match=r"aux layer 0 .* cannot be expressed in SGLang's convention"):
        export(_draft(tgt, aux=[0, 2, 3]), tgt, tmp_path / "x", "sglang")
    qwen2 = from_model(tiny_model("qwen2", vocab_size=128))
    with pytest.raises(ValueError, match=r"supports EAGLE-3 draft layers of model_type \['llama', 'qwen3'\]; "
                                         r".*'qwen2'"):
        export(_draft(qwen2, dv=50), qwen2, tmp_path / "x", "speculators")
    assert not (tmp_path / "x").exists()


def test_aux_scale_is_folded_into_fc_and_never_exported(tmp_path, tiny_target_dir):
    """A draft with aux_scale exports the same tensor keys as one without; its fc.weight is W·diag(scale), so an
    engine feeding raw features computes what the draft computes on scaled ones."""
    tgt = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    d = _draft(tgt, aux_scale=True)
    scale = torch.exp(torch.empty(3 * 64).uniform_(-4, 4, generator=torch.Generator().manual_seed(1)))
    d.set_aux_scale(scale)
    aux = torch.randn(2, 5, 3 * 64) * 30  # [B, S, 3H]
    folded = d.fc.weight.detach() * scale[None]
    ref = aux @ folded.T  # [B, S, H]
    torch.testing.assert_close(d.fuse(aux), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    out = export(d, tgt, tmp_path / "spec", "speculators", "/v", 3, torch.float32)
    t = load_file(str(out / "model.safetensors"))
    assert set(t) == SPECULATORS_KEYS == required_keys(d, "speculators") and "aux_scale" in d.state_dict()
    torch.testing.assert_close(t["fc.weight"], folded)
    # the checkpoint keeps the scale (config flag + buffer) and reloads to the same fused features
    d.save_pretrained(tmp_path / "ckpt", tgt.identity)
    back = Eagle3Draft.from_pretrained(tmp_path / "ckpt", tgt)
    assert back.config.aux_scale and torch.equal(back.aux_scale, d.aux_scale)
    torch.testing.assert_close(back.fuse(aux), d.fuse(aux))
    plain = _draft(tgt)  # without the flag: no buffer, fc reads the raw features
    assert "aux_scale" not in plain.state_dict()
    ref = aux @ plain.fc.weight.detach().T
    torch.testing.assert_close(plain.fuse(aux), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


def _qwen3_target_dir(root: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
    d = root / "tiny-qwen3"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


@pytest.mark.slow  # ~12 s in a child process of .venv-spec; CI runs it (and fails if it cannot)
def test_speculators_loads_our_export_and_reproduces_our_logits(tmp_path, tiny_target_dir):
    """Llama (through the export job), Llama with norm_before_residual, and Qwen3 drafts; L=13 (not a multiple
    of the flex block size) and 3 TTT steps: speculators' per-step draft-vocab logits equal ours."""
    spec_py = speculators_python()
    from draftheads.scripts.export import main as export_main

    cases = []
    llama = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    d = _draft(llama)
    d.save_pretrained(tmp_path / "ckpt", llama.identity)
    export_main(compose("export", ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true",
                                   f"checkpoint={tmp_path / 'ckpt'}", "dtype=fp32", f"out={tmp_path / 'e-llama'}",
                                   "speculative_tokens=3"]))
    cases.append(("llama", llama, d, tmp_path / "e-llama"))
    d2 = _draft(llama, seed=1, norm_before_residual=True)
    export(d2, llama, tmp_path / "e-nbr", "speculators", str(tiny_target_dir), 3, torch.float32)
    cases.append(("llama-nbr", llama, d2, tmp_path / "e-nbr"))
    qdir = _qwen3_target_dir(tmp_path)
    from transformers import AutoModelForCausalLM

    qwen3 = from_model(AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32), name=str(qdir))
    d3 = _draft(qwen3, seed=2)
    export(d3, qwen3, tmp_path / "e-qwen3", "speculators", str(qdir), 3, torch.float32)
    cases.append(("qwen3", qwen3, d3, tmp_path / "e-qwen3"))
    d5 = _draft(llama, seed=4, aux_scale=True)  # per-channel feature scale, folded into fc.weight by the export
    d5.set_aux_scale(torch.exp(torch.empty(3 * 64).uniform_(-5, 5, generator=torch.Generator().manual_seed(4))))
    export(d5, llama, tmp_path / "e-scale", "speculators", str(tiny_target_dir), 3, torch.float32)
    cases.append(("aux-scale", llama, d5, tmp_path / "e-scale"))
    d4 = _draft(llama, dv=400, seed=3)  # the whole target vocabulary: identity mapping, no d2t/t2d in the export
    export(d4, llama, tmp_path / "e-full", "speculators", str(tiny_target_dir), 3, torch.float32)
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "e-full" / "model.safetensors")))
    cases.append(("full-vocab", llama, d4, tmp_path / "e-full"))

    L, k = 13, 3
    args, ours = [], {}
    g = torch.Generator().manual_seed(0)
    for name, tgt, draft, out in cases:
        seq = torch.randint(0, 400, (1, L + 1), generator=g)
        hid = tgt(seq, layers=AUX, logits=False)["hidden"]
        aux = torch.cat([hid[a][:, :L] for a in AUX], -1)  # [1, L, 3H] features at t
        ids = seq[:, 1:]  # x_{t+1}
        save_file({"hidden_states": aux.contiguous(), "input_ids": ids.contiguous(), "ttt_steps": torch.tensor([k])},
                  str(tmp_path / f"{name}-in.safetensors"))
        with torch.no_grad():
            outs = draft.rollout(aux, torch.cat([ids, torch.zeros(1, k - 1, dtype=torch.long)], 1),
                                 torch.arange(L)[None], torch.ones(L, L, dtype=torch.bool).tril()[None], k)
            ours[name] = torch.stack([draft.logits(o)[0] for o in outs])  # [k, L, DV]
        args += [str(out), str(tmp_path / f"{name}-in.safetensors"), str(tmp_path / f"{name}-out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(spec_py), str(REPO / "scripts" / "speculators_check.py"), *args], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    for name, *_ in cases:
        rep = json.loads((tmp_path / f"{name}-out" / "report.json").read_text())
        assert rep["missing_in_file"] == rep["unexpected_in_file"] == rep["value_mismatch"] == [], rep
        assert rep["layer_class"] == ("Qwen3DecoderEagle3FirstLayer" if name == "qwen3"
                                      else "LlamaDecoderEagle3FirstLayer")
        assert rep["norm_before_residual"] == (name == "llama-nbr") and rep["aux_layer_ids"] == AUX
        res = load_file(str(tmp_path / f"{name}-out" / "result.safetensors"))
        assert res["logits"].shape == ours[name].shape == (k, L, 400 if name == "full-vocab" else 100)
        scale = float(ours[name].abs().max())
        assert float((res["logits"] - ours[name]).abs().max()) < 1e-5 * scale, name
        assert torch.equal(res["ids"], ours[name].argmax(-1)), name


def test_roundtrip_option_refuses_a_missing_python_and_another_format(tmp_path, tiny_target_dir):
    from draftheads.scripts.export import main as export_main

    llama = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    _draft(llama).save_pretrained(tmp_path / "ckpt", llama.identity)
    base = ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true",
            f"checkpoint={tmp_path / 'ckpt'}", f"out={tmp_path / 'e'}"]
    with pytest.raises(ValueError, match=r"speculators_python=.*no-such-python is not a file.*make_speculators_venv"):
        export_main(compose("export", base + [f"speculators_python={tmp_path / 'no-such-python'}"]))
    assert not (tmp_path / "e").exists()  # refused before anything is written
    with pytest.raises(ValueError, match="checks a speculators export; format is 'sglang'"):
        export_main(compose("export", base + ["format=sglang", f"speculators_python={SPEC_PY}"]))


@pytest.mark.slow  # 8-14 s: a whole job chain or a child process; the fast tier keeps the unit checks
def test_export_job_round_trip_through_speculators_on_a_chat_prompt(tmp_path, tiny_target_dir):
    """``speculators_python=`` makes the export job itself reload a bf16 export in speculators: exact keys and
    values, fp32 logits equal ours on a chat-templated prompt + greedy answer."""
    spec_py = speculators_python()
    from draftheads.scripts.export import main as export_main

    llama = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    _draft(llama, seed=4).save_pretrained(tmp_path / "ckpt", llama.identity)
    s = export_main(compose("export", ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true",
                                       f"checkpoint={tmp_path / 'ckpt'}", "dtype=bf16", f"out={tmp_path / 'e'}",
                                       "speculative_tokens=3", f"speculators_python={spec_py}"]))
    rt = s["speculators_roundtrip"]
    assert rt["steps"] == 3 and rt["positions"] > 16  # the templated prompt + 16 greedy tokens
    assert rt["missing_in_file"] == rt["unexpected_in_file"] == rt["value_mismatch"] == []
    assert rt["fp32_max_abs_diff"] < 1e-5 * rt["logit_scale"] and rt["fp32_argmax_equal"] == 1.0
    assert rt["export_dtype_argmax_equal"] > 0.5  # bf16 weights: most argmaxes survive the rounding
    assert load_file(str(tmp_path / "e" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_a_required_round_trip_fails_instead_of_skipping(tmp_path, monkeypatch):
    """Without the environment the round-trip tests skip on a developer's machine, but fail where .ci/run requires
    them; CI_SPECULATORS=0 leaves the variable unset (or 0), which skips again."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.delenv(REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no speculators environment at .*no-venv"):
        speculators_python(missing)
    monkeypatch.setenv(REQUIRE, "0")
    with pytest.raises(pytest.skip.Exception):
        speculators_python(missing)
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match="DRAFTHEADS_REQUIRE_SPECULATORS=1 requires the speculators round"):
        speculators_python(missing)
    missing.parent.mkdir(parents=True)
    missing.write_text("")
    assert speculators_python(missing) == missing
