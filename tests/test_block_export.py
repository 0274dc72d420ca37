"""Block draft export: a ``context=kv`` draft becomes a speculators ``dflash`` checkpoint whose block logits,
computed by speculators' own modules, equal ours; the export job finds the exporter through the registry."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import compose
from draftheads.heads.block import BlockDraft, block_config_for, default_mask_token
from draftheads.heads.block_export import check_export, dflash_config, export, export_tensors
from draftheads.heads.target import load_target
from test_export import speculators_python


def _draft(tgt, context: str = "kv", seed: int = 0, aux_scale: bool = False) -> BlockDraft:
    torch.manual_seed(seed)
    d = BlockDraft(block_config_for(tgt, [1, 2, 3], 2, 4, context, aux_scale=aux_scale), tgt)
    for p in d.parameters():  # trained-looking weights: norms away from 1, projections well away from 0
        p.data.normal_(0, 0.2) if p.ndim == 2 else p.data.uniform_(0.5, 1.5)
    if aux_scale:  # per-channel scales over three orders of magnitude either way
        d.set_aux_scale(torch.exp(torch.empty(3 * 64).uniform_(-4, 4)))
    return d


@pytest.fixture(scope="module")
def llama(tiny_target_dir):
    return load_target({"name": str(tiny_target_dir), "dtype": "fp32", "local_files_only": True})


def test_layout_names_and_strict_check(tmp_path, llama, tiny_target_dir):
    d = _draft(llama)
    assert d.config.mask_token_id == default_mask_token(llama) == 0  # the tiny target's pad (not its eos, 2)
    out = export(d, llama, tmp_path / "e", str(tiny_target_dir), torch.bfloat16)
    t = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert "hidden_norm.weight" in t and "context_norm.weight" not in t and "embed_tokens.weight" not in t
    assert {"layers.1.self_attn.q_norm.weight", "layers.1.mlp.down_proj.weight", "fc.weight", "norm.weight"} <= set(t)
    assert t["fc.weight"].shape == (64, 3 * 64) and t["fc.weight"].dtype == torch.bfloat16
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4 and cfg["mask_token_id"] == 0
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2 and cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = export_tensors(d, torch.float32)
    del tensors["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        check_export(tensors, dflash_config(d, "v", ["LlamaForCausalLM"], torch.float32), d, "here")
    scaled = _draft(llama, seed=1, aux_scale=True)  # the scale is folded into fc.weight, never exported itself
    t = export_tensors(scaled, torch.float32)
    assert set(t) == set(tensors) | {"norm.weight"} and "aux_scale" in scaled.state_dict()
    torch.testing.assert_close(t["fc.weight"], scaled.fc.weight.detach() * scaled.aux_scale[None])
    with pytest.raises(ValueError, match="head.context=kv"):
        export(_draft(llama, "prefix"), llama, tmp_path / "p", "v")
    with pytest.raises(ValueError, match="mask_token_id must be a token id"):
        block_config_for(llama, [1, 2], 2, 4, "kv", mask_token_id=10_000)


@pytest.mark.slow  # a child process with its own Python
def test_export_job_round_trip_through_speculators(tmp_path, llama, tiny_target_dir):
    """The export job reads the family from the checkpoint, writes a bf16 dflash export and reloads it in
    speculators: exact keys and values, and speculators' fp32 block logits on a chat prompt equal ours (the draft's
    per-channel feature scale folded into the exported fc.weight)."""
    spec_py = speculators_python()
    from draftheads.scripts.export import main as export_main

    _draft(llama, seed=3, aux_scale=True).save_pretrained(tmp_path / "ckpt", llama.identity)  # scale folded into fc
    s = export_main(compose("export", ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true",
                                       f"checkpoint={tmp_path / 'ckpt'}", "dtype=bf16", f"out={tmp_path / 'e'}",
                                       f"speculators_python={spec_py}"]))
    rt = s["speculators_roundtrip"]
    assert s["model_type"] == "dflash" and rt["class"] == "DFlashDraftModel" and rt["num_layers"] == 2
    assert rt["missing_in_file"] == rt["unexpected_in_file"] == rt["value_mismatch"] == []
    assert rt["context_positions"] > 10 and rt["mask_token_id"] == 0 and rt["block_size"] == 4
    assert rt["fp32_max_abs_diff"] < 1e-5 * rt["logit_scale"] and rt["fp32_argmax_equal"] == 1.0


def test_export_job_refuses_a_family_without_exporter_and_a_format_it_lacks(tmp_path, llama, tiny_target_dir):
    from draftheads.heads.medusa import MedusaHeads, medusa_config_for
    from draftheads.scripts.export import main as export_main

    base = ["target=hf", f"target.name={tiny_target_dir}", "target.local_files_only=true"]
    MedusaHeads(medusa_config_for(llama, 2, 1, False), llama.lm_head()).save_pretrained(tmp_path / "m", llama.identity)
    with pytest.raises(ValueError, match="family 'medusa' has no exporter; families that export: eagle3, block"):
        export_main(compose("export", base + [f"checkpoint={tmp_path / 'm'}", f"out={tmp_path / 'o'}"]))
    _draft(llama).save_pretrained(tmp_path / "b", llama.identity)
    with pytest.raises(ValueError, match=r"format must be one of \('speculators',\).*got 'sglang'"):
        export_main(compose("export", base + [f"checkpoint={tmp_path / 'b'}", "format=sglang", f"out={tmp_path / 'o'}"]))
    assert not (tmp_path / "o").exists()
