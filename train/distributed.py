"""Launch topology for the loop: what the launcher asked for (single, DDP, DeepSpeed ZeRO-2/3, FSDP2),
the accelerator built for it (CPU gloo included), mixed precision by device, and sharding of the frozen
target. Hyperparameters never choose the topology; the launcher does (conf/launch/)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from draftheads.heads.target import bf16_is_fast

log = logging.getLogger(__name__)

# accelerate hides FSDP from itself when we apply FSDP2 ourselves; remember that the launch asked for it.
_FSDP_ENV = "DRAFTHEADS_USE_FSDP"


def requested_launch() -> str:
    """What the launcher asked for (accelerate's environment): 'deepspeed', 'fsdp' or 'default'."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or os.environ.get(_FSDP_ENV) == "1":
        return "fsdp"
    return "default"


def launch_mode(acc: Any) -> str:
    """single | ddp | deepspeed | fsdp, as this process actually runs."""
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.DEEPSPEED:
        return "deepspeed"
    if requested_launch() == "fsdp" and acc.num_processes > 1:
        return "fsdp"
    return "ddp" if acc.num_processes > 1 else "single"


def zero_stage(acc: Any) -> int | None:
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def _ensure_single_process_env() -> None:
    """DeepSpeed needs a process group even for one process started without a launcher."""
    if os.environ.get("LOCAL_RANK") is None:
        import socket

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", str(port))})


def _fill_deepspeed_config(acc: Any, cfg: Any) -> None:
    """Batch, accumulation and clipping come from conf/train + conf/optim, never from the DeepSpeed JSON.

    The draft stays fp32 inside the engine (bf16/fp16 engine modes forced off) and ``train.mixed_precision``
    applies torch.autocast, exactly as in the other modes, so every launch config computes the same numbers
    (the draft is small; its fp32 master copy is what matters)."""
    ds = acc.state.deepspeed_plugin.deepspeed_config
    t, o = cfg.train, cfg.optim
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"the DeepSpeed config sets {key!r}; the optimizer and LR schedule come from "
                             f"conf/optim (remove {key!r} from the JSON)")
    for key in ("bf16", "fp16"):
        if str(ds.get(key, {}).get("enabled", False)).lower() in ("true", "auto") and key in ds:
            log.info("DeepSpeed %s engine mode turned off: the draft keeps fp32 weights and train.mixed_precision "
                     "autocasts its compute", key)
        ds[key] = {"enabled": False}
    ds["train_micro_batch_size_per_gpu"] = int(t.batch_size)
    ds["gradient_accumulation_steps"] = int(t.grad_accum)
    ds["train_batch_size"] = int(t.batch_size) * int(t.grad_accum) * acc.num_processes
    ds["gradient_clipping"] = float(o.max_grad_norm or 0.0)
    ds.setdefault("steps_per_print", 10 ** 9)


def resolve_mixed_precision(mp: str, device: str | torch.device) -> str:
    """train.mixed_precision with ``auto`` resolved: bf16 where the device computes it natively, else no
    (fp32): on AVX2-only CPUs bf16 autocast is far slower than fp32 (heads/target.py:bf16_is_fast)."""
    if mp == "auto":
        return "bf16" if bf16_is_fast(device) else "no"
    if mp not in ("no", "bf16", "fp16"):
        raise ValueError(f"train.mixed_precision must be auto, no, bf16 or fp16, got {mp!r}")
    return mp


def make_accelerator(cfg: Any):
    """An Accelerator for the configured device and precision and the launcher's topology.

    - CPU needs ``cpu=True`` to form a (gloo) process group for DDP.
    - DeepSpeed: accelerate replaces DeepSpeed by plain CPU DDP when told ``cpu=True``; to run the real
      engine on CPU we let accelerate take the DeepSpeed path with a gloo process group instead
      (DeepSpeed picks its CPU accelerator by itself).
    - FSDP: the loop applies FSDP2 ``fully_shard`` itself (same code on CPU and GPU; accelerate has no
      CPU FSDP), so FSDP is hidden from accelerate, which then runs plain DDP-style bookkeeping.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    from draftheads.train.checks import check_train_config

    check_train_config(cfg)  # grad_accum=0, cuda without CUDA, ...: errors, not a silent wrong run
    t = cfg.train
    device = t.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"train.device must be auto, cpu or cuda, got {device!r}")
    mp = resolve_mixed_precision(t.mixed_precision, device)
    kw: dict[str, Any] = dict(mixed_precision=mp, gradient_accumulation_steps=int(t.grad_accum))
    # accelerate keeps its state per process; a previous job in this process (a Hydra sweep, tests) must not
    # leak its precision, accumulation or plugins into this one. The process group (PartialState) stays.
    from accelerate.state import AcceleratorState, GradientState

    if AcceleratorState._shared_state:
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    req = requested_launch()
    if req == "deepspeed":
        if mp == "fp16":
            raise ValueError("train.mixed_precision=fp16 is not supported under DeepSpeed here (the draft stays fp32 "
                             "with autocast and no loss scaling): use bf16 or no")
        if device == "cpu":
            _ensure_single_process_env()
            acc = Accelerator(cpu=False, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")], **kw)
        else:
            acc = Accelerator(**kw)
        _fill_deepspeed_config(acc, cfg)
        # accelerate registers its DeepSpeed config with transformers, which then builds every model under
        # zero.Init when the stage is 3 - the frozen target included, lm_head and embeddings partitioned.
        # Drafts read those directly, so the target loads whole and shard_frozen_target() partitions only
        # its decoder layers (train.shard_target).
        try:
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        except ImportError:  # pragma: no cover
            pass
    elif req == "fsdp":
        os.environ[_FSDP_ENV] = "1"
        os.environ["ACCELERATE_USE_FSDP"] = "false"
        acc = Accelerator(cpu=device == "cpu", **kw)
    else:
        acc = Accelerator(cpu=device == "cpu", **kw)
    set_seed(int(t.seed))
    if not acc.is_main_process:
        _quiet_non_main_rank()
    return acc


def _quiet_non_main_rank() -> None:
    """Only rank 0 writes log files (Hydra's job log) and info messages; other ranks keep warnings on stderr."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler):
            root.removeHandler(h)
            h.close()
    root.setLevel(logging.WARNING)


def launch_info(acc: Any, mode: str | None = None) -> dict[str, Any]:
    """What actually ran (logged into run_info.json / summary.json; tests assert it)."""
    mode = mode or launch_mode(acc)
    return {"mode": mode, "distributed_type": str(acc.distributed_type).split(".")[-1],
            "num_processes": acc.num_processes, "device": str(acc.device.type),
            "backend": getattr(acc.state, "backend", None), "zero_stage": zero_stage(acc)}


# ------------------------------------------------------------------------------------------
# Sharding helpers (FSDP2 for drafts and frozen targets; ZeRO-3 for frozen targets)
# ------------------------------------------------------------------------------------------

def _device_mesh(acc: Any):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(acc.device.type, (acc.num_processes,))


def _plain_copy(objective: nn.Module) -> nn.Module:
    """An unsharded host-memory copy of the draft (sharing the frozen target, which is never copied), from
    which rank 0 writes head files under FSDP. Parameters are cloned straight to CPU, so the device never
    holds a second copy."""
    import copy

    memo: dict[int, Any] = {}
    target = getattr(objective, "target", None)
    if target is not None:
        memo[id(target)] = target
        for m in target.modules():
            memo[id(m)] = m
        for t in list(target.parameters()) + list(target.buffers()):
            memo[id(t)] = t
    for prm in objective.parameters():
        if id(prm) not in memo:
            memo[id(prm)] = nn.Parameter(prm.detach().to("cpu", copy=True), requires_grad=prm.requires_grad)
    for buf in objective.buffers():
        if id(buf) not in memo:
            memo[id(buf)] = buf.detach().to("cpu", copy=True)
    return copy.deepcopy(objective, memo)


def shard_frozen_target(target: Any, acc: Any, mode: str, ds_stage: int | None) -> dict[str, Any]:
    """Shard the frozen target's decoder layers over processes (it never enters an optimizer).

    Only the decoder layers are sharded; embeddings, final norm and lm_head stay whole on every rank
    because drafts call them directly (Medusa's shared lm_head, EAGLE's embedding). FSDP2: one
    ``fully_shard`` per layer (all-gathered for its forward, freed after). ZeRO-3: a parameter-only
    DeepSpeed engine (no optimizer) partitions the layers and gathers each in its forward hook.
    Returns what it did, with the share of decoder-layer parameters this rank holds (≈ 1/processes)."""
    layers = target.decoder_layers()
    total = sum(p.numel() for p in layers.parameters())
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = _device_mesh(acc)
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        local = sum(p.to_local().numel() for p in layers.parameters())
        return {"kind": "fsdp2-decoder-layers", "local_fraction": local / max(1, total)}
    if mode == "deepspeed" and ds_stage == 3:
        import deepspeed

        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": acc.num_processes, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_live_parameters": 10 ** 9, "stage3_prefetch_bucket_size": 0},
              "bf16": {"enabled": False}, "fp16": {"enabled": False}}
        engine, *_ = deepspeed.initialize(model=layers, config=ds)
        object.__setattr__(target, "_ds_layers_engine", engine)  # keep it alive; never stepped
        local = sum(p.ds_tensor.numel() for p in layers.parameters())
        return {"kind": "zero3-decoder-layers", "local_fraction": local / max(1, total)}
    raise ValueError(f"train.shard_target=true needs an FSDP or DeepSpeed ZeRO-3 launch (this one is {mode}"
                     + (f", ZeRO-{ds_stage}" if ds_stage is not None else "") + ")")


def _safe_deepspeed_checkpoint_engine(engine: Any) -> None:
    """Make the engine read its checkpoint files with ``torch.load(weights_only=True)``.

    DeepSpeed's own loader unpickles (``weights_only=False``), which executes code from the file. Our
    resume only ever reads checkpoints this loop wrote, but a copied run directory is still a file from
    somewhere else: with this, anything but tensors, containers and the few allow-listed DeepSpeed
    value types fails to load instead of running."""
    try:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    except ImportError:  # pragma: no cover
        return
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or type(ce) is not TorchCheckpointEngine:
        return

    def load(path, map_location=None):
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)

    ce.load = load


def _deepspeed_safe_globals() -> list[Any]:
    import argparse
    import collections

    out: list[Any] = [argparse.Namespace, collections.OrderedDict, set]
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        out += [LossScaler, DynamicLossScaler]
    except ImportError:  # pragma: no cover
        pass
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        out.append(ZeroStageEnum)
    except ImportError:  # pragma: no cover
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        out.append(fragment_address)
    except ImportError:  # pragma: no cover
        pass
    return out
