"""Export a trained draft for serving engines: ``python scripts/export.py checkpoint=DIR format=FMT``.

The checkpoint's family names its exporter in heads/registry.py (a module with ``FORMATS`` and ``export_job``);
this job checks the output folder, loads the target and hands over. EAGLE-3's exporter is this module; the block
draft's is heads/block_export.py (speculators ``dflash``). What follows is EAGLE-3's.

Formats (each a directory with ``config.json`` + ``model.safetensors``):

* ``speculators`` — the vLLM ``speculators`` layout (``speculators_model_type: eagle3``): tensors
  ``fc.weight`` (the draft's ``aux_scale``, if any, folded in), ``layers.0.*``, ``norm.weight``,
  ``lm_head.weight``, ``embed_tokens.weight`` (written from the target), ``d2t``, ``t2d`` (omitted when the draft vocabulary is the whole target vocabulary:
  engines build no mapping then); config with ``transformer_layer_config`` (model_type set
  explicitly: without it speculators silently assumes qwen3), ``draft_vocab_size``,
  ``norm_before_residual`` (written explicitly: vLLM and speculators default it differently),
  ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (algorithm, greedy proposal,
  verifier name_or_path + architectures).
* ``sglang`` — the SGLang / SpecForge layout: a flat Llama config with
  ``architectures: [LlamaForCausalLMEagle3]``, top-level ``draft_vocab_size`` and the aux ids under
  ``eagle_config``; tensors as above with ``layers.0.`` renamed ``midlayer.``.

Aux layer ids: ours (and vLLM's) id i is the *input* of decoder layer i. SGLang adds one to explicit
ids (its id i is the *output* of layer i), so the sglang export writes i-1 — and refuses id 0.

Every export is checked strictly before it is renamed into place: exactly the required tensor keys
(none missing, none extra) with the expected shapes and dtypes, and the required config fields.
Loading an export back into speculators is tested (tests/test_export.py, scripts/speculators_check.py);
``speculators_python=PATH`` (a Python with the ``speculators`` package, ``scripts/make_speculators_venv.sh``)
makes the job do that round trip on the exported checkpoint itself: speculators loads the export and its
per-step logits on one chat-templated prompt (the target's real fused features) must equal ours.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]

from draftheads.heads import job, outputs  # noqa: E402
from draftheads.heads.checkpoint import atomic_dir, save_safetensors  # noqa: E402
from draftheads.heads.eagle3 import Eagle3Draft, check_vocab_mapping  # noqa: E402
from draftheads.heads.speculators_gate import chat_prompt_ids, check_python, gate  # noqa: E402
from draftheads.heads.target import FrozenTarget, TargetConfig, load_target, parse_dtype, resolve_target  # noqa: E402

log = logging.getLogger(__name__)

FORMATS = ("speculators", "sglang")
SPECULATORS_LAYER_TYPES = ("llama", "qwen3")  # draft-layer families speculators 0.9 builds
SGLANG_LAYER_TYPES = ("llama",)  # LlamaForCausalLMEagle3
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Layer-config fields a serving engine needs to rebuild the draft layer.
LAYER_CONFIG_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                       "attention_bias", "attention_dropout", "mlp_bias", "initializer_range", "bos_token_id",
                       "eos_token_id", "pad_token_id")
SPECULATORS_CONFIG_FIELDS = ("speculators_model_type", "transformer_layer_config", "draft_vocab_size",
                             "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "speculators_config")
SGLANG_CONFIG_FIELDS = ("architectures", "model_type", "draft_vocab_size", "vocab_size", "hidden_size",
                        "num_hidden_layers", "eagle_config", "tie_word_embeddings")


def _core_keys(prefix: str, mapping: bool) -> set[str]:
    """Tensors every EAGLE-3 export has, whatever the layer family (a guard against a drifting module)."""
    layer = {f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"}
    layer |= {f"{prefix}.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    layer |= {f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return layer | {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"} | (
        {"d2t", "t2d"} if mapping else set())


def _has_mapping(draft: Eagle3Draft) -> bool:
    """A draft over the whole target vocabulary has the identity mapping; engines then expect no d2t/t2d
    (speculators builds no such buffers and would report them as unexpected)."""
    return draft.config.draft_vocab_size != draft.config.vocab_size


def _rename(k: str, prefix: str) -> str:
    return prefix + k[len("layers.0"):] if k.startswith("layers.0.") else k


def export_tensors(draft: Eagle3Draft, target: FrozenTarget, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The export's tensors: the draft's weights (renamed for sglang), the target's embedding, d2t/t2d."""
    prefix = "layers.0" if fmt == "speculators" else "midlayer"
    out: dict[str, torch.Tensor] = {}
    for k, v in draft.exported_state_dict().items():  # aux_scale folded into fc.weight: engines feed raw features
        if k in ("d2t", "t2d"):
            if _has_mapping(draft):
                out[k] = v.detach().cpu()
            continue
        out[_rename(k, prefix)] = v.detach().to("cpu", dtype)
    out["embed_tokens.weight"] = target.embed_tokens().weight.detach().to("cpu", dtype)
    return {k: v.contiguous() for k, v in out.items()}


def required_keys(draft: Eagle3Draft, fmt: str) -> set[str]:
    prefix = "layers.0" if fmt == "speculators" else "midlayer"
    mapping = _has_mapping(draft)
    keys = {_rename(k, prefix) for k in draft.exported_state_dict() if mapping or k not in ("d2t", "t2d")}
    keys.add("embed_tokens.weight")
    core = _core_keys(prefix, mapping)
    assert core <= keys, f"the draft module lacks export tensors {sorted(core - keys)}"
    return keys


def check_export(tensors: dict[str, torch.Tensor], config: dict[str, Any], fmt: str, required: set[str],
                 where: str) -> None:
    """Strict check: exactly the required keys, the right shapes/dtypes, and the config fields engines read."""
    missing, extra = sorted(required - set(tensors)), sorted(set(tensors) - required)
    if missing or extra:
        raise ValueError(f"{where}: {fmt} export does not have exactly the required tensors: missing {missing}, "
                         f"unexpected {extra}")
    need = SPECULATORS_CONFIG_FIELDS if fmt == "speculators" else SGLANG_CONFIG_FIELDS
    absent = [k for k in need if k not in config]
    if absent:
        raise ValueError(f"{where}: {fmt} config.json lacks required fields {absent}")
    lc = config["transformer_layer_config"] if fmt == "speculators" else config
    if fmt == "speculators" and "model_type" not in lc:
        raise ValueError(f"{where}: transformer_layer_config lacks model_type (speculators would assume qwen3)")
    H, V, DV = int(lc["hidden_size"]), int(lc["vocab_size"]), int(config["draft_vocab_size"])
    n_aux = len(config["eagle_aux_hidden_state_layer_ids"] if fmt == "speculators"
                else config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    prefix = "layers.0" if fmt == "speculators" else "midlayer"
    shapes = {"fc.weight": (H, n_aux * H), "lm_head.weight": (DV, H), "embed_tokens.weight": (V, H),
              "norm.weight": (H,), f"{prefix}.hidden_norm.weight": (H,), f"{prefix}.input_layernorm.weight": (H,)}
    for p in "qkv":
        shapes[f"{prefix}.self_attn.{p}_proj.weight"] = (tensors[f"{prefix}.self_attn.{p}_proj.weight"].shape[0], 2 * H)
    for k, s in shapes.items():
        if tuple(tensors[k].shape) != s:
            raise ValueError(f"{where}: tensor {k} has shape {tuple(tensors[k].shape)}, expected {s}")
    if DV != V:
        check_vocab_mapping(tensors["d2t"], tensors["t2d"], DV, V, where)


def _layer_config(draft: Eagle3Draft) -> dict[str, Any]:
    d = json.loads(draft.layer_config.to_json_string(use_diff=False))
    out = {k: d[k] for k in LAYER_CONFIG_FIELDS if k in d}
    out.update(vocab_size=draft.config.vocab_size, num_hidden_layers=1, tie_word_embeddings=False)
    if d.get("layer_types"):
        out["layer_types"] = list(d["layer_types"][:1])
    return out


def speculators_config(draft: Eagle3Draft, verifier: str, verifier_architectures: list[str], speculative_tokens: int,
                       dtype: torch.dtype) -> dict[str, Any]:
    c = draft.config
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_config(draft),
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": bool(c.norm_before_residual),
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),  # id i = input of decoder layer i (vLLM's convention)
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "dtype": DTYPE_NAMES[dtype],
    }


def sglang_config(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, Any]:
    c = draft.config
    if c.norm_before_residual:
        raise ValueError("the sglang format has no norm_before_residual (its midlayer keeps the un-normed residual); "
                         "export this draft with format=speculators")
    if min(c.aux_layers) < 1:
        raise ValueError(f"aux layer 0 (the embedding output) cannot be expressed in SGLang's convention "
                         f"(its id i is the output of decoder layer i); aux layers are {c.aux_layers}")
    lc = _layer_config(draft)
    rope = lc.pop("rope_parameters", None) or {}
    out = {"architectures": ["LlamaForCausalLMEagle3"], **lc, "draft_vocab_size": c.draft_vocab_size,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in c.aux_layers],
                            "use_aux_hidden_state": True},
           "torch_dtype": DTYPE_NAMES[dtype]}
    if "rope_theta" in rope:  # engines on older transformers read the flat field
        out["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    return out


def export(draft: Eagle3Draft, target: FrozenTarget, out: str | Path, fmt: str, verifier: str | None = None,
           speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the export directory atomically after a strict check; returns its path."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    model_type = draft.layer_config.model_type
    allowed = SPECULATORS_LAYER_TYPES if fmt == "speculators" else SGLANG_LAYER_TYPES
    if model_type not in allowed:
        raise ValueError(f"the {fmt} format supports EAGLE-3 draft layers of model_type {list(allowed)}; this draft "
                         f"was built from the target's {model_type!r} layer")
    if fmt == "speculators":
        archs = list(getattr(target.config, "architectures", None) or [type(target.model).__name__])
        config = speculators_config(draft, verifier or target.identity.name, archs, speculative_tokens, dtype)
    else:
        config = sglang_config(draft, dtype)
    tensors = export_tensors(draft, target, fmt, dtype)
    check_export(tensors, config, fmt, required_keys(draft, fmt), f"export of {fmt}")
    with atomic_dir(out, owner="export") as tmp:  # replaces only an earlier export, never other files
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})  # umask's mode, not 0600
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return Path(out)


def verify_export(path: str | Path, draft: Eagle3Draft, fmt: str) -> None:
    """Read an export back and re-run the strict check (what the job does after writing)."""
    path = Path(path)
    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    check_export(tensors, config, fmt, required_keys(draft, fmt), str(path))


ROUNDTRIP_PROMPT = "Explain in three sentences why the sky is blue."
ROUNDTRIP_REL_TOL = 1e-4  # max |logit difference| / max |logit| of the fp32 round trip (measured ~4e-7)


def _roundtrip_inputs(draft: Eagle3Draft, target: FrozenTarget, prompt: str, new_tokens: int,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused aux features [1, L, n·H] and next tokens [1, L] of a chat-templated prompt + the target's greedy answer."""
    seq = chat_prompt_ids(target, prompt)  # [1, T]
    with torch.no_grad():
        for _ in range(new_tokens):  # a short greedy answer, so the positions include assistant text
            nxt = target(seq)["logits"][:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        hid = target(seq, layers=draft.config.aux_layers, logits=False)["hidden"]
    L = seq.shape[1] - 1
    aux = torch.cat([hid[a][:, :L] for a in draft.config.aux_layers], -1).float()  # [1, L, n·H] features at t
    return aux, seq[:, 1:]  # x_{t+1}


_check_speculators_python = check_python


def speculators_roundtrip(draft: Eagle3Draft, target: FrozenTarget, export_dir: str | Path, python: str | Path,
                          steps: int, prompt: str = ROUNDTRIP_PROMPT, new_tokens: int = 16) -> dict[str, Any]:
    """Load an export with the ``speculators`` package (in its own Python) and compare with our draft.

    Two loads in one subprocess: the export as written (its keys and values must be exactly what speculators'
    model holds) and an fp32 copy whose per-step logits must equal ours (fp32 draft) within
    ``ROUNDTRIP_REL_TOL``; the export's own dtype only reports argmax agreement. Raises ``ValueError`` on a
    mismatch, so a CI job can gate publishing on it.
    """
    python = Path(python)
    _check_speculators_python(python)
    assert target.dtype == torch.float32, "the round trip compares fp32 logits"
    export_dir = Path(export_dir)
    aux, ids = _roundtrip_inputs(draft, target, prompt, new_tokens)
    L = ids.shape[1]
    draft = draft.float().eval()
    with torch.no_grad():
        outs = draft.rollout(aux, torch.cat([ids, torch.zeros(1, steps - 1, dtype=ids.dtype, device=ids.device)], 1),
                             torch.arange(L, device=ids.device)[None],
                             torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()[None], steps)
        ours = torch.stack([draft.logits(o)[0] for o in outs]).cpu()  # [k, L, DV]
    with tempfile.TemporaryDirectory(prefix="draftheads-roundtrip-") as tmp:
        tmp = Path(tmp)
        save_file({"hidden_states": aux.cpu().contiguous(), "input_ids": ids.cpu().contiguous(),
                   "ttt_steps": torch.tensor([steps])}, str(tmp / "in.safetensors"))
        # the same verifier as the export: speculators loads the verifier's weights from it
        verifier = json.loads((export_dir / "config.json").read_text())["speculators_config"]["verifier"]
        fp32_dir = export(draft, target, tmp / "fp32", "speculators", verifier["name_or_path"], steps, torch.float32)
        args = [str(export_dir), str(tmp / "in.safetensors"), str(tmp / "as-exported"),
                str(fp32_dir), str(tmp / "in.safetensors"), str(tmp / "fp32-out")]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # its own environment: nothing of ours on its path
        r = subprocess.run([str(python), str(REPO / "scripts" / "speculators_check.py"), *args],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise ValueError(f"speculators could not load or run the export {export_dir} (with {python}):\n"
                             f"{r.stderr[-3000:]}")
        report = json.loads((tmp / "as-exported" / "report.json").read_text())
        got = load_file(str(tmp / "as-exported" / "result.safetensors"))
        got32 = load_file(str(tmp / "fp32-out" / "result.safetensors"))
    if got32["logits"].shape != ours.shape:
        raise ValueError(f"speculators returned logits of shape {tuple(got32['logits'].shape)} for the export "
                         f"{export_dir}; ours are {tuple(ours.shape)} [steps, positions, draft vocab]")
    scale = float(ours.abs().max())
    diff = float((got32["logits"] - ours).abs().max())
    result = {"positions": L, "steps": steps, "missing_in_file": report["missing_in_file"],
              "unexpected_in_file": report["unexpected_in_file"], "value_mismatch": report["value_mismatch"],
              "fp32_max_abs_diff": diff, "logit_scale": scale,
              "fp32_argmax_equal": float((got32["ids"] == ours.argmax(-1)).float().mean()),
              "export_dtype_argmax_equal": float((got["ids"] == ours.argmax(-1)).float().mean())}
    return gate(result, export_dir, "logits", ROUNDTRIP_REL_TOL)


def export_job(cfg: DictConfig, target: FrozenTarget, out: Path, dtype: torch.dtype, verifier: str) -> dict[str, Any]:
    """EAGLE-3's exporter (heads/registry.py): load, write, re-check, optionally round-trip."""
    if cfg.get("speculators_python"):
        assert target.dtype == torch.float32, "the round trip compares fp32 logits"
    draft = Eagle3Draft.from_pretrained(cfg.checkpoint, target, bool(cfg.allow_target_mismatch))
    ck = json.loads((Path(cfg.checkpoint) / "config.json").read_text())
    steps = job.config_int(cfg, "speculative_tokens", int(ck.get("ttt_steps") or 3), 1)  # null: the trained k
    export(draft, target, out, cfg.format, verifier, steps, dtype)
    verify_export(out, draft, cfg.format)
    summary = {"out": str(out), "format": cfg.format, "verifier": verifier, "dtype": cfg.dtype,
               "aux_layers": draft.config.aux_layers, "draft_vocab_size": draft.config.draft_vocab_size,
               "speculative_tokens": steps}
    if cfg.get("speculators_python"):
        summary["speculators_roundtrip"] = speculators_roundtrip(draft, target, out, cfg.speculators_python, steps)
    return summary


def _exporter(checkpoint: str) -> Any:
    """The exporter module (``FORMATS``, ``export_job``) of the checkpoint's family, from the registry."""
    from draftheads.heads import registry

    path = Path(checkpoint) / "config.json"
    try:
        family = json.loads(path.read_text()).get("family")
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint={checkpoint}: cannot read {path} ({e}); point checkpoint at a head directory "
                         f"written by a training job") from None
    fam = registry.get(str(family))
    if not fam.exporter:
        have = [f.name for f in registry.FAMILIES.values() if f.exporter]
        raise ValueError(f"checkpoint={checkpoint}: family {family!r} has no exporter; families that export: "
                         f"{', '.join(have)}")
    return fam.load("exporter")


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    from draftheads.heads import registry

    known = tuple(dict.fromkeys(f for fam in registry.FAMILIES.values() if fam.exporter
                                for f in fam.load("exporter").FORMATS))
    if cfg.format not in known:
        raise ValueError(f"format must be one of {known}, got {cfg.format!r}")
    dtype = parse_dtype(cfg.dtype)
    check = cfg.get("speculators_python")
    if check and cfg.format != "speculators":
        raise ValueError(f"speculators_python checks a speculators export; format is {cfg.format!r}")
    if check:  # before anything is written
        _check_speculators_python(Path(check))
    out = Path(cfg.out or f"{str(cfg.checkpoint).rstrip('/')}-{cfg.format}")
    outputs.refuse_inside(out, {"head checkpoint": Path(cfg.checkpoint)})  # before any model loads
    outputs.check_replaceable(out, "export", overwrite=bool(cfg.overwrite))
    exporter = _exporter(str(cfg.checkpoint))
    if cfg.format not in exporter.FORMATS:
        raise ValueError(f"format must be one of {exporter.FORMATS} for this checkpoint's family, got {cfg.format!r}")
    outputs.claim(out, "export")
    # the round trip compares fp32 logits; the export itself is cast to `dtype` either way
    tcfg = TargetConfig(**{**{k: v for k, v in dict(cfg.target).items() if k in TargetConfig.__dataclass_fields__},
                           "dtype": "fp32" if check else cfg.dtype})
    target = load_target(tcfg)
    verifier = cfg.verifier or resolve_target(tcfg)[0]
    # ---- export + check (+ the round trip through the speculators package)
    summary = exporter.export_job(cfg, target, out, dtype, verifier)
    log.info("exported: %s", json.dumps(summary))
    print(json.dumps(summary), flush=True)
    return summary


@job.main(config_name="export")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
