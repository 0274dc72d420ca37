"""Export a ``context=kv`` block draft as a ``speculators`` 0.9 ``dflash`` checkpoint (what vLLM loads).

The layouts match one to one (heads/block_layers.py follows DFlash): ``fc.weight`` (the draft's ``aux_scale``, if
any, folded in), ``hidden_norm.weight`` (our
``context_norm``), ``layers.i.*`` (q/k/v/o projections, per-head q/k norms, the two layer norms, the gated MLP) and
``norm.weight``. The embedding and lm_head are the target's: speculators rebuilds both from the verifier, so the
export holds neither; a draft with its own vocabulary (``head.draft_vocab_size``) also holds ``lm_head.weight``
(its rows of the target's head, which engines cannot rebuild) and ``d2t``/``t2d``, as speculators saves them. The config carries
``mask_token_id``, ``block_size``, the context layer ids (``aux_hidden_state_layer_ids``, our ids: the input of
decoder layer i) and the layer config with ``num_hidden_layers`` = the draft's layers.

``export_job`` is the family's exporter (heads/registry.py): scripts/export.py calls it with the loaded target.
``speculators_python=PATH`` loads the export in that Python (scripts/speculators_dflash_check.py) and compares
its block logits with ours on a real prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftheads.heads.block import BlockDraft
from draftheads.heads.checkpoint import atomic_dir, save_safetensors
from draftheads.heads.speculators_gate import chat_prompt_ids, check_python, gate
from draftheads.heads.target import FrozenTarget

FORMATS = ("speculators",)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
LAYER_CONFIG_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                       "attention_bias", "attention_dropout", "mlp_bias", "initializer_range", "bos_token_id",
                       "eos_token_id", "pad_token_id")
LAYER_TYPES = ("llama", "qwen3")  # layer configs speculators builds its DFlash layers from (as for EAGLE-3)
ROUNDTRIP_REL_TOL = 1e-4  # max |logit difference| / max |logit| of the fp32 round trip
REPO = Path(__file__).resolve().parents[1]


def _rename(k: str) -> str:
    return "hidden_norm.weight" if k == "context_norm.weight" else k


def export_tensors(draft: BlockDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # d2t (int64) and t2d (bool) keep their dtypes: only the weights take the export's
    return {_rename(k): v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in draft.exported_state_dict().items()}


def dflash_config(draft: BlockDraft, verifier: str, verifier_architectures: list[str], dtype: torch.dtype,
                  ) -> dict[str, Any]:
    c = draft.config
    d = json.loads(draft.layer_config.to_json_string(use_diff=False))
    lc = {k: d[k] for k in LAYER_CONFIG_FIELDS if k in d}
    lc.update(vocab_size=c.vocab_size, num_hidden_layers=c.num_layers, tie_word_embeddings=False)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": lc,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": list(c.context_layers),
        "mask_token_id": int(c.mask_token_id),
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,  # the root is the verified token; mask entries 1..n-1 are the drafts
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "dtype": DTYPE_NAMES[dtype],
    }


def check_export(tensors: dict[str, torch.Tensor], config: dict[str, Any], draft: BlockDraft, where: str) -> None:
    """Exactly the draft's tensors under their dflash names and shapes, and the config fields speculators reads."""
    want = {_rename(k): tuple(v.shape) for k, v in draft.exported_state_dict().items()}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: dflash export does not have exactly the draft's tensors: missing {missing}, "
                         f"unexpected {extra}")
    for k, s in want.items():
        if tuple(tensors[k].shape) != s:
            raise ValueError(f"{where}: tensor {k} has shape {tuple(tensors[k].shape)}, expected {s}")
    for k in ("speculators_model_type", "transformer_layer_config", "block_size", "mask_token_id",
              "aux_hidden_state_layer_ids", "speculators_config"):
        if k not in config:
            raise ValueError(f"{where}: dflash config.json lacks {k}")
    if "model_type" not in config["transformer_layer_config"]:
        raise ValueError(f"{where}: transformer_layer_config lacks model_type (speculators would assume qwen3)")


def export(draft: BlockDraft, target: FrozenTarget, out: str | Path, verifier: str,
           dtype: torch.dtype = torch.bfloat16) -> Path:
    c = draft.config
    if c.context != "kv":
        raise ValueError(f"the speculators dflash format holds head.context=kv block drafts; this checkpoint has "
                         f"head.context={c.context!r} (train with head.context=kv)")
    model_type = draft.layer_config.model_type
    if model_type not in LAYER_TYPES:
        raise ValueError(f"the dflash export supports targets of model_type {list(LAYER_TYPES)}; this draft's "
                         f"target is {model_type!r}")
    archs = list(getattr(target.config, "architectures", None) or [type(target.model).__name__])
    config = dflash_config(draft, verifier, archs, dtype)
    tensors = export_tensors(draft, dtype)
    check_export(tensors, config, draft, "dflash export")
    with atomic_dir(out, owner="export") as tmp:  # replaces only an earlier export, never other files
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return Path(out)


def _roundtrip_inputs(draft: BlockDraft, target: FrozenTarget, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused context features [1, T, n·H] of a chat-templated prompt and its ids [1, T + 1] (the last id: the root)."""
    seq = chat_prompt_ids(target, prompt)  # [1, T+1]
    with torch.no_grad():
        hid = target(seq[:, :-1], layers=draft.config.context_layers, logits=False)["hidden"]
    return torch.cat([hid[a] for a in draft.config.context_layers], -1).float(), seq


def block_logits(draft: BlockDraft, features: torch.Tensor, root: int) -> torch.Tensor:
    """Our logits [n-1, DV or V] of the block rooted at ``root`` after context ``features`` [1, T, n·H] (as decoding)."""
    n, T = draft.config.block_size, features.shape[1]
    dev = features.device
    with torch.no_grad():
        ctx = draft.context(features)  # [1, T, H]
        kv = draft.context_kv(ctx, torch.arange(T, device=dev)[None])
        x = draft.block(torch.full((1, n), int(root), device=dev), torch.arange(n, device=dev)[None] > 0)
        h = draft(x, torch.arange(T, T + n, device=dev)[None], torch.ones(1, n, T + n, dtype=torch.bool,
                                                                           device=dev), kv)
        return draft.logits(h[0, 1:]).float().cpu()


def speculators_roundtrip(draft: BlockDraft, target: FrozenTarget, export_dir: str | Path, python: str | Path,
                          prompt: str = "Explain in three sentences why the sky is blue.") -> dict[str, Any]:
    """speculators (in its own Python) loads the export and recomputes the block; its fp32 logits must be ours."""
    python, export_dir = Path(python), Path(export_dir)
    check_python(python)
    assert target.dtype == torch.float32, "the round trip compares fp32 logits"
    draft = draft.float().eval()
    feats, seq = _roundtrip_inputs(draft, target, prompt)
    ours = block_logits(draft, feats, int(seq[0, -1]))
    verifier = json.loads((export_dir / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    with tempfile.TemporaryDirectory(prefix="draftheads-dflash-") as tmp:
        tmp = Path(tmp)
        save_file({"hidden_states": feats.cpu().contiguous(), "input_ids": seq.cpu().contiguous()},
                  str(tmp / "in.safetensors"))
        fp32 = export(draft, target, tmp / "fp32", verifier, torch.float32)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # its own environment: nothing of ours on its path
        r = subprocess.run([str(python), str(REPO / "scripts" / "speculators_dflash_check.py"), str(export_dir),
                            str(fp32), str(tmp / "in.safetensors"), str(tmp / "out")],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise ValueError(f"speculators could not load or run the export {export_dir} (with {python}):\n"
                             f"{r.stderr[-3000:]}")
        report = json.loads((tmp / "out" / "report.json").read_text())
        got = load_file(str(tmp / "out" / "result.safetensors"))["logits"]
    scale, diff = float(ours.abs().max()), float((got - ours).abs().max())
    result = {**report, "context_positions": int(feats.shape[1]), "fp32_max_abs_diff": diff, "logit_scale": scale,
              "fp32_argmax_equal": float((got.argmax(-1) == ours.argmax(-1)).float().mean())}
    return gate(result, export_dir, "block logits", ROUNDTRIP_REL_TOL)


def export_job(cfg: Any, target: FrozenTarget, out: Path, dtype: torch.dtype, verifier: str) -> dict[str, Any]:
    """The family's exporter (scripts/export.py): load, write, re-check, optionally round-trip."""
    draft = BlockDraft.from_pretrained(cfg.checkpoint, target, bool(cfg.allow_target_mismatch))
    export(draft, target, out, verifier, dtype)
    check_export(load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text()), draft,
                 str(out))
    c = draft.config
    summary = {"out": str(out), "format": "speculators", "model_type": "dflash", "verifier": verifier,
               "dtype": DTYPE_NAMES[dtype], "context_layers": c.context_layers, "block_size": c.block_size,
               "mask_token_id": c.mask_token_id, "speculative_tokens": c.block_size - 1}
    if cfg.get("speculators_python"):
        summary["speculators_roundtrip"] = speculators_roundtrip(draft, target, out, cfg.speculators_python)
    return summary
