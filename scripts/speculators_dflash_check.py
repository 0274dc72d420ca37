"""Load a speculators-format ``dflash`` export with the vLLM ``speculators`` package and draft one block with it.

    /path/to/speculators-venv/bin/python scripts/speculators_dflash_check.py EXPORT_DIR FP32_DIR INPUTS OUT_DIR

Runs in its own environment (speculators pins its own transformers), so it imports nothing from this repository.
EXPORT_DIR (as exported) is loaded for the key comparison: speculators only *prints* missing/unexpected keys, so
the file's keys and values are compared with the loaded model itself. FP32_DIR (the same draft in fp32) drafts
the block: INPUTS holds ``hidden_states`` [1, T, n·H] (the target's fused context features at 0..T-1) and
``input_ids`` [1, T + 1] (the last id is the block's root, at position T). The block is [root, mask, ...] and its
entries attend to every context entry and to each other, as at decoding time; speculators' own modules compute
it: ``fc`` + ``hidden_norm``, each layer with the context injected as keys/values, ``norm`` and the lm_head (the
verifier's, or the file's reduced one for a draft vocabulary). Writes OUT_DIR/result.safetensors (``logits``
[n-1, DV or V] of block entries 1..n-1) and OUT_DIR/report.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

NOT_SAVED = {"verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight", "lm_head.weight"}


def _load(path: str):
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(path)
    model.eval()
    model.config.transformer_layer_config._attn_implementation = "sdpa"  # no flex attention on CPU
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "sdpa"
    return model


def main(export_dir: str, fp32_dir: str, inputs: str, out_dir: str) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = _load(export_dir)
    file = load_file(str(Path(export_dir) / "model.safetensors"))
    state = model.state_dict()
    # a draft with its own vocabulary keeps its lm_head (and d2t/t2d) in the file
    expected = set(state) - (NOT_SAVED - ({"lm_head.weight"} if getattr(model, "use_draft_vocab", False) else set()))
    report = {"class": type(model).__name__, "layer_class": type(model.layers[0]).__name__,
              "num_layers": len(model.layers), "block_size": int(model.block_size),
              "mask_token_id": int(model.mask_token_id), "aux_layer_ids": list(model.target_layer_ids),
              "missing_in_file": sorted(expected - set(file)), "unexpected_in_file": sorted(set(file) - expected),
              "value_mismatch": []}
    for k in sorted(set(file) & expected):
        a, b = file[k], state[k].detach().cpu()
        if a.shape != b.shape or not torch.equal(a.to(b.dtype), b):
            report["value_mismatch"].append(k)
    model = _load(fp32_dir)
    inp = load_file(inputs)
    hs, ids = inp["hidden_states"].float(), inp["input_ids"]
    T, n = hs.shape[1], model.block_size
    block = torch.full((1, n), model.mask_token_id, dtype=torch.long)
    block[0, 0] = ids[0, -1]
    with torch.no_grad():
        ctx = model.hidden_norm(model.fc(hs))  # [1, T, H]
        x = model.embed_tokens(block)  # [1, n, H]
        pos = torch.arange(T + n)[None]
        emb = model.rotary_emb(x, pos)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                      position_embeddings=emb)
        logits = model.lm_head(model.norm(x))[0, 1:].float()  # [n-1, DV or V]
    save_file({"logits": logits.contiguous()}, str(out / "result.safetensors"))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    print(json.dumps(main(*sys.argv[1:])))
