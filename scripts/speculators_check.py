"""Load a speculators-format EAGLE-3 export with the vLLM ``speculators`` package and run its forward.

    /path/to/speculators-venv/bin/python scripts/speculators_check.py EXPORT_DIR INPUTS.safetensors OUT_DIR [...]

Runs in its own environment (speculators pins transformers <= 5.19; see README, "EAGLE-3 export"), so
it imports nothing from this repository. INPUTS holds ``hidden_states`` [1, L, n_aux·H] (the fused
aux features), ``input_ids`` [1, L] and ``ttt_steps`` [1]. Writes OUT_DIR/result.safetensors with the
per-step draft-vocab logits ``logits`` [k, L, DV] and argmax ids ``ids`` [k, L], and OUT_DIR/report.json
with the key comparison: speculators only *prints* missing/unexpected keys and re-initializes the
missing ones, so this script compares the file's keys and values with the loaded model itself.
Several (EXPORT_DIR, INPUTS, OUT_DIR) triples may follow each other: the package import is paid once.
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

# Tensors the speculators model holds but never saves (rebuilt from the verifier on load).
NOT_SAVED = {"verifier_lm_head.weight", "verifier_norm.weight"}


def main(export_dir: str, inputs: str, out_dir: str) -> dict:
    from speculators import SpeculatorModel
    from torch.nn.attention.flex_attention import create_mask

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = SpeculatorModel.from_pretrained(export_dir)
    model.eval()
    # Its default flex attention needs sequence lengths that are multiples of 128 on CPU when ttt_steps > 1.
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    model._attn_impl = "sdpa"
    model._create_mask_fn = create_mask
    file = load_file(str(Path(export_dir) / "model.safetensors"))
    state = model.state_dict()
    expected = set(state) - NOT_SAVED
    report = {"class": type(model).__name__, "missing_in_file": sorted(expected - set(file)),
              "unexpected_in_file": sorted(set(file) - expected), "value_mismatch": [],
              "layer_class": type(model.layers[0]).__name__,
              "norm_before_residual": bool(model.config.norm_before_residual),
              "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
              "attn_implementation": model.config.transformer_layer_config._attn_implementation}
    for k in sorted(set(file) & expected):
        a, b = file[k], state[k].detach().cpu()
        if a.shape != b.shape or not torch.equal(a.to(b.dtype), b):
            report["value_mismatch"].append(k)
    inp = load_file(inputs)
    hs, ids = inp["hidden_states"].to(model.fc.weight.dtype), inp["input_ids"]
    steps = int(inp["ttt_steps"][0])
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: logits.append(o.detach().float()))
    with torch.no_grad():
        toks = model(hidden_states=hs, input_ids=ids, document_ids=torch.zeros_like(ids),
                     position_ids=torch.arange(ids.shape[1])[None], ttt_steps=steps)
    hook.remove()
    save_file({"logits": torch.cat(logits).contiguous(), "ids": torch.cat(toks).contiguous()},
              str(out / "result.safetensors"))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 3:
        sys.exit(__doc__)
    for i in range(0, len(args), 3):
        print(json.dumps(main(*args[i:i + 3])))
