"""The frozen target model: load, freeze, and return logits plus the hidden states draft heads need.

Why a wrapper: every head family needs the same three things from the target — its tokenizer, its
hidden states at chosen layers, and its (frozen) embedding / lm_head — and every checkpoint must
record which target it was trained for. Keeping that in one place means Medusa, EAGLE and EAGLE-3
share loading, dtype handling, caching of the embedded GGUF and the identity check.

Layer convention (same as transformers' ``output_hidden_states``): ``hidden_states[0]`` is the
embedding output, ``hidden_states[i]`` (1 ≤ i ≤ L) the output of decoder layer i-1 (= input of
layer i), and index ``L`` is replaced by the *final-normed* last hidden state (what lm_head reads).

Where the target's files come from (the embedded GGUF, a local folder, the hub cache): heads/target_source.py.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from draftheads.heads.malloc import release_freed_memory
from draftheads.heads.target_source import EMBEDDED_TARGETS, SOURCE_FILE, resolve_target

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 matmuls run natively on ``device``: a CUDA GPU with bf16 support, or a CPU with
    AMX-BF16 or AVX512-BF16. Elsewhere (AVX2-only CPUs, e.g. many AMD EPYC hosts) torch emulates bf16 and
    it is far *slower* than fp32 (scripts/bench_dtype.py on a 2-core AMD EPYC: 1.3 vs 95 GFLOP/s), so ``auto``
    picks fp32 there."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type != "cpu":
        return False
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        c = caps()
        return bool(c.get("amx_bf16") or c.get("avx512_bf16"))
    try:  # older torch: the kernel's flags (Linux)
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a config string ('bf16', 'fp32', 'auto', ...) to a torch dtype with a clear error.

    ``auto``: bf16 where ``device`` computes it natively (:func:`bf16_is_fast`), else fp32."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """Map a config device ('auto', 'cpu', 'cuda', 'cuda:1') to a torch device with a clear error.

    ``auto``: the current CUDA GPU when one is visible, else the CPU — so the same command uses a GPU
    host's GPU and still runs on a laptop. Asking for CUDA where there is none is a user error."""
    if isinstance(name, torch.device):
        return name
    name = str(name)
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was asked for but torch sees no CUDA GPU (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda}); use device=auto or device=cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return dev


def dtype_name(dtype: torch.dtype) -> str:
    """The config spelling of a torch dtype (what results files record)."""
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class TargetIdentity:
    """What a head checkpoint records about the target it belongs to."""

    name: str  # hub id, local path or embedded name the user gave
    revision: str | None  # hub revision / commit, or the embedded file's sha256 prefix
    fingerprint: str  # sha256 (prefix) over the lm_head weights: catches a different model of the same shape
    model_type: str  # e.g. "llama", "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TargetIdentity":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


def check_identity(saved: dict[str, Any] | TargetIdentity, current: TargetIdentity, what: str,
                   strict_fingerprint: bool = True) -> None:
    """Refuse a checkpoint/cache made for another target, naming the mismatching field."""
    saved = saved if isinstance(saved, TargetIdentity) else TargetIdentity.from_dict(saved)
    for f in ("vocab_size", "hidden_size"):
        if getattr(saved, f) != getattr(current, f):
            raise ValueError(
                f"{what} was made for a different target: {f} is {getattr(saved, f)} there "
                f"(target {saved.name!r}) but {getattr(current, f)} for the loaded target {current.name!r}")
    if strict_fingerprint and saved.fingerprint and saved.fingerprint != current.fingerprint:
        raise ValueError(
            f"{what} was made for target {saved.name!r} (fingerprint {saved.fingerprint}), but the loaded target "
            f"{current.name!r} has fingerprint {current.fingerprint}: the weights differ. Pass "
            f"allow_target_mismatch=true to use it anyway.")


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------

@dataclass
class TargetConfig:
    """How to load the frozen target (mirrors conf/target/*.yaml)."""

    name: str = "smollm2-135m"  # embedded name, local dir or hub id
    revision: str | None = None  # hub revision (ignored for local/embedded)
    dtype: str = "auto"  # weights/compute dtype of the frozen target (auto: bf16 where native, else fp32)
    attn_implementation: str = "sdpa"  # sdpa | eager (tree masks work with both)
    trust_remote_code: bool = False  # only if the user asks
    local_files_only: bool = True  # never reach a hub at run time unless asked


def packed_rows(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook for an output layer: a [B, T, H] input whose leading strides are not its packed ones (the
    last position sliced off a longer [B, S, H], as transformers' ``logits_to_keep`` does at every prefill) gets a
    packed copy. torch does not fold such an input into one matrix product: it multiplies by the weight expanded
    to [B, H, V], which on CPU in bf16 means a copy of the whole lm_head per call (1 x 1 x 576 on SmolLM2: 56 ms
    against 3.4 ms packed, on 2 cores), and at a batched prefill an allocation that fails (128 rows on Gemma's 262k
    vocabulary: 40 GiB), after which torch turns oneDNN off for the whole process and every bf16 matmul runs
    several times slower. ``is_contiguous()`` does not see it: it ignores the strides of size-1 dimensions."""
    x = args[0]
    if x.dim() < 3:
        return None
    packed, step = [], 1
    for n in reversed(x.shape):
        packed.append(step)
        step *= n
    if x.stride() == tuple(reversed(packed)):
        return None
    return (x.new_empty(x.shape).copy_(x), *args[1:])  # [B, T, H], packed


class FrozenTarget(nn.Module):
    """A causal LM with frozen parameters in eval mode, plus its tokenizer and identity."""

    def __init__(self, model: nn.Module, tokenizer: Any, identity: TargetIdentity):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.identity = identity
        self.model.eval()
        self.model.requires_grad_(False)
        head = self.model.get_output_embeddings()
        if packed_rows not in head._forward_pre_hooks.values():  # a model wrapped twice gets it once
            head.register_forward_pre_hook(packed_rows)
        # transformers renamed past_key_values -> cache in v5; support both spellings.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # The train loop calls .train() on everything; the target must stay in eval mode.
    def train(self, mode: bool = True) -> "FrozenTarget":
        return self

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def logit_softcap(self) -> float | None:
        """Gemma 2/3's ``final_logit_softcapping``: the model's logits are cap·tanh(lm_head(h)/cap), not lm_head(h)."""
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return float(cap) if cap else None

    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def decoder_layers(self) -> nn.ModuleList:
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        return base.layers

    def new_cache(self):
        """A KV cache holding every position on every layer, sliding-window layers included.

        Why not ``DynamicCache(config=...)``: its sliding-window layers keep only the last ``window - 1`` positions,
        so a tree forward (more than one query, a ready mask over the whole prefix) does not line up with them, and
        the speculative loop's rollback (keep the prefix plus the accepted path) cannot restore positions they have
        dropped. The window is applied by the masks instead (the model's own, or eval.generate.tree_forward's)."""
        from transformers import DynamicCache

        return DynamicCache()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T] padding mask, or [B, 1, T, S] (tree/packed) mask
        position_ids: torch.Tensor | None = None,  # [B, T]
        layers: Sequence[int] = (),  # hidden-state indices to return (see module doc); -1 means L
        cache: Any = None,
        logits: bool | torch.Tensor = True,  # True: all positions; a bool mask [B, T]: only those; False: none
    ) -> dict[str, Any]:
        """One target forward.

        Returns ``{"logits": [B, T, V] or [n, V] or None, "hidden": {layer: [B, T, H]}, "cache": cache}``.
        Hidden states are captured with hooks on just the requested layers instead of
        ``output_hidden_states=True``, which would keep all L+1 of them alive.
        """
        L = self.num_layers
        wanted = sorted({L if l == -1 else l for l in layers})
        for l in wanted:
            if not 0 <= l <= L:
                raise ValueError(f"hidden-state layer {l} outside the target's range 0..{L} (it has {L} layers)")
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        dec_layers = self.decoder_layers()
        for l in wanted:
            if l < L:  # input of decoder layer l
                def pre_hook(mod, args, kwargs, _l=l):
                    hs = args[0] if args else kwargs["hidden_states"]
                    captured[_l] = hs
                hooks.append(dec_layers[l].register_forward_pre_hook(pre_hook, with_kwargs=True))
        try:
            base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
            kwargs = {self._cache_kw: cache, "use_cache": cache is not None}
            out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        last = out.last_hidden_state  # [B, T, H], final-normed
        if L in wanted:
            captured[L] = last
        if -1 in layers:
            captured[-1] = last
        if logits is True:
            lg = softcap(self.lm_head()(last), self.logit_softcap)
        elif logits is False or logits is None:
            lg = None
        else:
            lg = softcap(self.lm_head()(last[logits]), self.logit_softcap)  # [n, V]
        return {"logits": lg, "hidden": captured, "last_hidden": last, "cache": cache}


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(logits/cap), as transformers' Gemma models finish their logits (identity for cap None)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _fingerprint(model: nn.Module, rows: int = 4096) -> str:
    """Hash of the lm_head rounded to bf16, so fp32 and bf16 loads of the same weights agree.

    Hashed ``rows`` at a time (the same bytes in the same order): a whole-matrix fp32 copy of a 262k-row lm_head
    and its bytes would be ~1.3 GB of transient memory."""
    w = model.get_output_embeddings().weight.detach()
    h = hashlib.sha256()
    for i in range(0, w.shape[0], rows):
        h.update(w[i:i + rows].to("cpu", torch.bfloat16).to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def load_tokenizer(path: str, **kw: Any) -> Any:
    """The target's tokenizer; a folder we converted from a GGUF loads its serialized tokenizer.json as is.

    Why: there the file is the tokenizer (written by the conversion, fingerprinted with the folder), and a
    model-specific class in transformers 5 rebuilds the same Rust tokenizer from a Python copy of the vocabulary and
    merges that it keeps: ~150 MB resident for Gemma 3's 262k ids, in every training and eval process.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(path)
    if (folder / SOURCE_FILE).is_file() and (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, **kw)
    return AutoTokenizer.from_pretrained(path, **kw)


def load_target(cfg: TargetConfig | dict | Any, device: str | torch.device = "cpu") -> FrozenTarget:
    """Load any transformers causal LM (local dir, hub id, or an embedded name) frozen and in eval mode."""
    from transformers import AutoModelForCausalLM

    if not isinstance(cfg, TargetConfig):
        cfg = TargetConfig(**{k: v for k, v in dict(cfg).items() if k in TargetConfig.__dataclass_fields__})
    path, revision = resolve_target(cfg)
    kw = dict(revision=cfg.revision if cfg.name not in EMBEDDED_TARGETS else None,
              trust_remote_code=cfg.trust_remote_code, local_files_only=cfg.local_files_only)
    try:
        tokenizer = load_tokenizer(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=parse_dtype(cfg.dtype, device), attn_implementation=cfg.attn_implementation, **kw)
    except OSError as e:
        hint = " (set target.local_files_only=false to allow a hub download)" if cfg.local_files_only else ""
        raise ValueError(f"could not load target {cfg.name!r}: {e}{hint}") from None
    model.to(device)
    if revision is None:
        src = Path(path) / SOURCE_FILE
        revision = json.loads(src.read_text())["revision"] if src.is_file() else getattr(
            model.config, "_commit_hash", None)
    identity = TargetIdentity(
        name=cfg.name, revision=revision, fingerprint=_fingerprint(model), model_type=model.config.model_type,
        vocab_size=model.get_output_embeddings().weight.shape[0], hidden_size=model.config.hidden_size,
        num_layers=model.config.num_hidden_layers)
    release_freed_memory()  # the tokenizer's parse buffers and the loading's copies, freed above
    return FrozenTarget(model, tokenizer, identity)


def from_model(model: nn.Module, tokenizer: Any = None, name: str = "in-memory") -> FrozenTarget:
    """Wrap an already-built model (tests build tiny random ones from configs)."""
    identity = TargetIdentity(
        name=name, revision=None, fingerprint=_fingerprint(model), model_type=model.config.model_type,
        vocab_size=model.get_output_embeddings().weight.shape[0], hidden_size=model.config.hidden_size,
        num_layers=model.config.num_hidden_layers)
    return FrozenTarget(model, tokenizer, identity)
