"""The training loop every head family shares: accelerate devices/processes, deterministic data
order, AdamW + warmup/cosine, accumulation, clipping, logging, atomic checkpoints, exact resume.

A family plugs in an *objective*: an ``nn.Module`` that owns the draft (registered, trainable) and
holds the frozen target unregistered (so DDP/DeepSpeed never see its parameters), and whose
``forward(batch)`` returns ``(loss_sum, stats)``: the loss summed over this micro-batch's valid
tokens, and a dict ``name -> (sum, count)`` of tensors for logging. The loop divides by the number
of valid tokens in the *global* batch (all micro-batches of all processes in one optimizer step),
so 1 process × batch 2B and 2 processes × batch B give the same update.

Launch topology comes from the launcher (``accelerate launch --config_file conf/launch/<x>.yaml``), never
from the hyperparameters: single process, DDP (nccl on GPU, gloo on CPU), DeepSpeed ZeRO-2/3 (the real
engine, also on CPU over gloo) and FSDP2 (applied by this loop on CPU and GPU alike). The frozen target
is never part of an optimizer; with ``train.shard_target`` its decoder layers can be sharded too. Every
mode writes the same checkpoint layout: ``step-N/`` is a loadable head (gathered on rank 0) and
``trainer_state/`` holds what an exact resume needs (see ``Trainer.save_checkpoint``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from heads.checkpoint import atomic_dir, atomic_write_text
from heads.target import bf16_is_fast

log = logging.getLogger(__name__)

CKPT_RE = re.compile(r"^step-(\d+)$")


class Objective(Protocol):
    """What a family supplies to the loop (see module doc)."""

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        ...

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Number of valid loss tokens in a micro-batch (the normalizer)."""
        ...

    def save_pretrained(self, path: Path, extra: dict[str, Any]) -> None:
        ...

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the tensors ``save_pretrained`` wrote (resume in single/DDP modes)."""
        ...

    # Optional, for the simulated τ the loop logs on held-out data (see ``Trainer.simulated_tau``):
    #   acceptance_ranks(batch) -> (LongTensor [n, D], int): at each of n scored positions, the rank of the
    #       greedy reference token among the draft's depth-d candidates (d = 1..D, conditioned on the
    #       reference prefix; any value >= top_k means "not among the candidates"; D fixed), and how many
    #       positions were considered before the greedy-continuation filter (for the coverage figure).
    #       Under ZeRO-3/FSDP it must call the same draft modules on every rank, even for n = 0.
    #   sim_tree_paths() -> list of rank paths (the static tree eval would verify), or None for chain only.


# ------------------------------------------------------------------------------------------
# Deterministic data order
# ------------------------------------------------------------------------------------------

class GlobalBatches:
    """Yields this rank's micro-batches (lists of dataset indices) for optimizer steps ``start..``.

    The data order is a function of (seed, epoch) only: epoch e visits ``randperm(n, seed + e)``, and
    optimizer step s takes positions ``[s·G, (s+1)·G)`` of that endless stream, G = micro × world × accum.
    Resuming at step s is therefore just starting the stream at s — no loader state to restore — and
    any process layout with the same G sees the same examples in each step.
    """

    def __init__(self, lengths: Sequence[int], micro_batch: int, world: int, rank: int, accum: int, seed: int,
                 group_by_length: bool = True):
        self.lengths = np.asarray(lengths)
        self.n = len(lengths)
        self.micro, self.world, self.rank, self.accum, self.seed = micro_batch, world, rank, accum, seed
        self.global_batch = micro_batch * world * accum
        self.group_by_length = group_by_length
        self._perms: dict[int, np.ndarray] = {}
        if self.n < self.global_batch:
            raise ValueError(f"the training set has {self.n} examples, fewer than one global batch "
                             f"({micro_batch} × {world} processes × {accum} accumulation = {self.global_batch})")

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).numpy()}
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        """All G indices of optimizer step ``step`` (every rank computes the same list)."""
        out = []
        for p in range(step * self.global_batch, (step + 1) * self.global_batch):
            out.append(int(self._perm(p // self.n)[p % self.n]))
        return out

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's ``accum`` micro-batches of step ``step``."""
        idx = self.step_indices(step)
        if self.group_by_length:  # similar lengths share a micro-batch: less padding, same example set
            idx = sorted(idx, key=lambda i: (-int(self.lengths[i]), i))
        chunks = [idx[j:j + self.micro] for j in range(0, len(idx), self.micro)]  # world·accum chunks
        # chunk c goes to rank c % world, micro-step c // world
        return [chunks[a * self.world + self.rank] for a in range(self.accum)]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n


# ------------------------------------------------------------------------------------------
# Schedule
# ------------------------------------------------------------------------------------------

def lr_lambda(warmup: int, total: int, min_ratio: float = 0.0, schedule: str = "cosine") -> Callable[[int], float]:
    """Linear warmup to 1, then cosine (or constant / linear) decay to ``min_ratio``."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return min_ratio + (1 - min_ratio) * (1 - prog)
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
        raise ValueError(f"optim.schedule must be cosine, linear or constant, got {schedule!r}")
    return f


# ------------------------------------------------------------------------------------------
# RNG state (saved without pickle: tensors and lists only, loadable with weights_only=True)
# ------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    py = random.getstate()
    npst = np.random.get_state()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], torch.from_numpy(npst[1].astype(np.int64)), npst[2], npst[3], npst[4]],
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    n = st["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ------------------------------------------------------------------------------------------
# Checkpoint discovery
# ------------------------------------------------------------------------------------------

def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (temp dirs start with '.' and are ignored), oldest first.

    A checkpoint counts only once its ``trainer_state/state.json`` exists: that file is written last,
    inside the temp dir, before the rename, so a job killed at any instant leaves either a complete
    ``step-N/`` or a ``.step-N.tmp`` that is never picked up."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (p / "trainer_state" / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


# ------------------------------------------------------------------------------------------
# Launch topology
# ------------------------------------------------------------------------------------------

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

    from train.checks import check_train_config

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


def lockstep_batches(num_rows: int, batch_size: int, acc: Any) -> list[tuple[list[int], bool]]:
    """This rank's share of rows 0..num_rows-1 as (indices, counted) batches, the same number on every rank.

    Why: under ZeRO-3/FSDP (draft or target sharded) every forward is collective, so a rank that stops
    early would leave the others waiting forever. Ranks short of a batch in the last round repeat batch 0
    with counted=False (run, but not added to the metrics)."""
    batches = [list(range(i, min(i + batch_size, num_rows))) for i in range(0, num_rows, batch_size)]
    world, rank = acc.num_processes, acc.process_index
    rounds = -(-len(batches) // world)
    out = []
    for r in range(rounds):
        j = r * world + rank
        out.append((batches[j], True) if j < len(batches) else (batches[0], False))
    return out


def greedy_windows(batch: dict[str, torch.Tensor], top_hidden: torch.Tensor, lm_head: Callable, width: int,
                   ) -> tuple[torch.Tensor, int]:
    """The positions an objective's ``acceptance_ranks`` scores, and how many were considered.

    ``top_hidden`` [B, T, H] is what the target's ``lm_head`` reads, teacher-forced on the held-out row, so its
    argmax at t is the target's greedy choice of token t+1 given the reference prefix. Position t is scored
    (win[b, t], win [B, max(T - width, 0)]) when tokens t+1 .. t+width are all assistant tokens of t's document
    that equal those greedy choices: decoding greedily from the prefix x_<=t would produce them, with x_{t+1}
    as the step's root and t+2 .. t+width checked against draft depths 1 .. width-1. Considered: positions whose
    next token is an assistant token (the coverage denominator)."""
    from data_prep.dataset import shifted_valid

    ids = batch["input_ids"]
    B, T = ids.shape
    greedy = torch.stack([lm_head(top_hidden[i]).argmax(-1) for i in range(B)])  # [B, T]: token t+1 (row by row)
    nxt = shifted_valid(batch, 1)  # [B, T-1]: token t+1 is an assistant token
    follows = nxt & (ids[:, 1:] == greedy[:, :-1])  # [B, T-1]: ... and the target's greedy choice
    n_pos = max(T - width, 0)
    win = follows.unfold(1, width, 1).all(-1)[:, :n_pos] if n_pos > 0 else follows.new_zeros(B, 0)
    return win, int(nxt.sum())


def reference_ranks(candidates: torch.Tensor, ref: torch.Tensor, top_k: int) -> torch.Tensor:
    """[n] rank of ref[i] among candidates[i] ([n, k] ids, best first); ``top_k`` where it is not among them."""
    hit = candidates == ref[:, None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(ref, top_k))


def accepted_lengths(ranks: torch.Tensor, paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Accepted draft tokens per position from candidate ranks [n, D] (>= top_k: not a candidate).

    Chain (paths=None): the leading run of rank-0 hits. Static tree: the reference's rank path
    (r_1, r_2, ...) is followed while it is a node of the tree — exactly what greedy verification of
    that tree accepts, since at each depth at most one candidate equals the reference token."""
    if ranks.numel() == 0:
        return torch.zeros(ranks.shape[0], dtype=torch.long)
    if paths is None:
        return (ranks == 0).long().cumprod(dim=1).sum(dim=1)
    nodes = {tuple(int(x) for x in p) for p in paths}
    out = torch.zeros(ranks.shape[0], dtype=torch.long)
    for i, row in enumerate(ranks.tolist()):
        d = 0
        while d < len(row) and tuple(row[: d + 1]) in nodes:
            d += 1
        out[i] = d
    return out


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


# ------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    out_dir: Path
    final_dir: Path
    steps: int
    history: list[dict[str, Any]]
    seconds: float
    tokens_per_s: float
    peak_memory_mb: float
    steps_per_s: float = 0.0
    launch: dict[str, Any] = field(default_factory=dict)  # mode, distributed_type, processes, ZeRO stage
    peak_memory_mb_per_rank: list[float] = field(default_factory=list)  # process peak RSS, every rank
    peak_loop_memory_mb_per_rank: list[float] = field(default_factory=list)  # peak RSS during fit() only
    trainable_params: int = 0
    eval: dict[str, Any] | None = None  # eval_after summary (tau, tokens/s), rank 0 only
    tau_best: dict[str, Any] | None = None  # train.tau_eval: {"step", "tau"} of the head kept in best/

    def summary_fields(self) -> dict[str, Any]:
        """What every family's summary.json carries about scale-out (the sweep report reads these)."""
        return {"launch": self.launch, "steps_per_s": round(self.steps_per_s, 4),
                "trainable_params": self.trainable_params,
                "peak_rss_mb_per_rank": [round(x, 1) for x in self.peak_memory_mb_per_rank],
                "peak_rss_loop_mb_per_rank": [round(x, 1) for x in self.peak_loop_memory_mb_per_rank],
                "eval": self.eval, "tau_best": self.tau_best}


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux), so the loop's peak is not the model-loading peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_mb() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return _peak_rss_mb()


class Trainer:
    """Runs the loop for one objective. Construct, then ``fit()``.

    ``heldout`` (+ ``heldout_collate``, default: the training collate) enables the simulated τ
    (objectives that implement ``acceptance_ranks``) every ``train.eval_every`` steps and at the end."""

    def __init__(self, cfg: Any, accelerator: Any, objective: nn.Module, train_data: Any, collate: Callable,
                 out_dir: Path, checkpoint_extra: dict[str, Any] | None = None,
                 evaluate: Callable[[int], dict] | None = None, heldout: Any = None,
                 heldout_collate: Callable | None = None,
                 tau_eval: Callable[[int, Path], dict[str, Any]] | None = None):
        self.cfg = cfg
        self.acc = accelerator
        self.objective = objective
        self.data = train_data
        self.collate = collate
        self.out_dir = Path(out_dir)
        self.extra = checkpoint_extra or {}
        self.evaluate = evaluate  # held-out metrics every train.eval_every steps and before the final save
        self.heldout = heldout
        self.heldout_collate = heldout_collate or collate
        t, o = cfg.train, cfg.optim
        self.max_steps = int(t.max_steps)
        self.accum = int(t.grad_accum)
        self.mode = launch_mode(self.acc)
        self.zero_stage = zero_stage(self.acc)
        self.target_sharding = self._maybe_shard_target()
        self._shadow: nn.Module | None = None
        if self.mode == "fsdp":  # shard first: FSDP2 swaps parameters, the optimizer must see the new ones
            from torch.distributed.fsdp import fully_shard

            self._shadow = _plain_copy(objective) if self.acc.is_main_process else None
            fully_shard(objective, mesh=_device_mesh(self.acc),
                        reshard_after_forward=os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false")
        params = [p for p in objective.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the draft has no trainable parameters")
        self.trainable_params = int(sum(p.numel() for p in params))
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": float(o.weight_decay)},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=float(o.lr), betas=tuple(o.betas), eps=float(o.eps))
        warmup = int(o.warmup_steps) if o.warmup_steps is not None else int(o.warmup_ratio * self.max_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup, self.max_steps, float(o.min_lr_ratio), o.schedule))
        if self.mode == "fsdp":
            self.model, self.optimizer = objective, self.acc.prepare(self.optimizer)
        else:
            self.model, self.optimizer = self.acc.prepare(self.objective, self.optimizer)
        if self.mode == "deepspeed":
            _safe_deepspeed_checkpoint_engine(self.model)
        self.batches = GlobalBatches(
            [len(x) for x in train_data["input_ids"]], int(t.batch_size), self.acc.num_processes,
            self.acc.process_index, self.accum, int(t.seed), bool(t.group_by_length))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self._init_tau_eval(tau_eval)
        self.launch = {**launch_info(self.acc, self.mode), "target_sharding": self.target_sharding,
                       "engine": type(self.model).__name__}

    # ------------------------------------------------------------------ topology
    def _maybe_shard_target(self) -> dict[str, Any] | None:
        want = str(self.cfg.train.get("shard_target", "false")).lower()
        if want not in ("auto", "true", "false"):
            raise ValueError(f"train.shard_target must be auto, true or false, got {want!r}")
        target = getattr(self.objective, "target", None)
        sharding_launch = self.mode == "fsdp" or (self.mode == "deepspeed" and self.zero_stage == 3)
        if want == "false" or target is None or (want == "auto" and not sharding_launch):
            return None
        return shard_frozen_target(target, self.acc, self.mode, self.zero_stage)

    def _autocast(self):
        """train.mixed_precision as torch.autocast in every mode (DeepSpeed keeps the draft fp32, see above)."""
        mp = resolve_mixed_precision(self.cfg.train.mixed_precision, self.acc.device)
        if self.mode == "deepspeed" and mp != "no":
            return torch.autocast(device_type=self.acc.device.type, dtype=torch.bfloat16)
        return self.acc.autocast()

    @contextmanager
    def _full_draft(self) -> Iterator[None]:
        """Draft parameters usable by direct submodule calls (held-out metrics): FSDP unshards them for the
        duration; ZeRO-3 gathers per module in its hooks (lockstep over ranks, see lockstep_batches)."""
        if self.mode == "fsdp":
            self.model.unshard()
            try:
                yield
            finally:
                self.model.reshard()
        else:
            yield

    # ------------------------------------------------------------------ state
    def _unwrapped(self) -> nn.Module:
        return self.acc.unwrap_model(self.model) if self.mode != "fsdp" else self.model

    def _opt(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer

    def _write_head(self, tmp: Path, extra: dict[str, Any]) -> None:
        """Rank 0 writes a loadable head (config.json + model.safetensors) with *full* draft weights."""
        acc = self.acc
        if self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if acc.is_main_process:
                assert self._shadow is not None
                self._shadow.load_state_dict(full)
                self._shadow.save_pretrained(tmp, extra=extra)
                from heads.checkpoint import save_safetensors  # the umask's mode, not safetensors' 0600

                (tmp / "trainer_state").mkdir()
                save_safetensors({k: v.contiguous() for k, v in full.items()}, tmp / "trainer_state" / "draft.safetensors")
        elif self.mode == "deepspeed" and self.zero_stage == 3:
            import deepspeed

            obj = self._unwrapped()
            with deepspeed.zero.GatheredParameters(list(obj.parameters()), modifier_rank=None):
                if acc.is_main_process:
                    obj.save_pretrained(tmp, extra=extra)
        elif acc.is_main_process:
            self._unwrapped().save_pretrained(tmp, extra=extra)  # creates tmp
        if acc.is_main_process:
            (tmp / "trainer_state").mkdir(exist_ok=True)

    def save_checkpoint(self) -> Path:
        """step-N/ = a loadable head checkpoint + trainer_state/, written to .step-N.tmp and renamed.

        trainer_state/: scheduler.pt, rng-rank{r}.pt (every rank), state.json (step, data position,
        global batch, launch; written last) and the optimizer: optimizer.pt (single/DDP: the torch state;
        FSDP: the full, gathered state + draft.safetensors with the draft's own parameter names) or
        deepspeed/ (ZeRO: the engine's partitioned checkpoint, one optimizer shard per rank).
        The directory must be on a filesystem all ranks share (multi-node: a shared volume)."""
        acc = self.acc
        root = self.out_dir / "checkpoints"
        final_dir = root / f"step-{self.step:06d}"
        tmp = root / f".step-{self.step:06d}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        acc.wait_for_everyone()
        self._write_head(tmp, {**self.extra, "step": self.step})
        acc.wait_for_everyone()
        ts = tmp / "trainer_state"
        # Every rank saves its own RNG state: noise/dropout streams differ per rank.
        torch.save(rng_state(), ts / f"rng-rank{acc.process_index}.pt")
        if self.mode == "deepspeed":
            self.model.save_checkpoint(str(ts / "deepspeed"), tag="engine", client_state={}, save_latest=False)
        elif self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            osd = get_optimizer_state_dict(self.model, self._opt(),
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if acc.is_main_process:
                torch.save(osd, ts / "optimizer.pt")
        elif acc.is_main_process:
            torch.save(self._opt().state_dict(), ts / "optimizer.pt")
        if acc.is_main_process:
            torch.save(self.scheduler.state_dict(), ts / "scheduler.pt")
            self._save_tau_best(ts)
        acc.wait_for_everyone()
        if acc.is_main_process:
            (ts / "state.json").write_text(json.dumps({
                "step": self.step, "global_batch": self.batches.global_batch, "world": acc.num_processes,
                "data_position": self.step * self.batches.global_batch,
                "epoch": round(self.batches.epoch_of(self.step), 6), "seed": int(self.cfg.train.seed),
                "max_steps": self.max_steps, "launch": self.launch, "tau_best": self.tau_best,
                "data": self.extra.get("data")}))
            if final_dir.exists():
                shutil.rmtree(final_dir)
            os.replace(tmp, final_dir)
            keep = int(self.cfg.train.keep_last)
            ckpts = list_checkpoints(self.out_dir)
            for _, p in ckpts[:-keep] if keep > 0 else []:
                shutil.rmtree(p, ignore_errors=True)
        acc.wait_for_everyone()
        return final_dir

    def try_resume(self) -> bool:
        from train.resume import check_same_data, explain_state_mismatch, pick_checkpoint, trim_metrics

        picked = pick_checkpoint(self.out_dir)  # newest complete one; all incomplete: an error naming them
        if picked is None:
            log.info("resume requested but no checkpoint in %s: starting fresh", self.out_dir / "checkpoints")
            if self.acc.is_main_process:
                trim_metrics(self.metrics_path, 0)  # a fresh start must not append to an old run's rows
            return False
        step, path = picked
        ts = path / "trainer_state"
        st = json.loads((ts / "state.json").read_text())
        check_same_data(path, st, self.extra.get("data"), self.cfg)
        if st["global_batch"] != self.batches.global_batch:
            raise ValueError(
                f"cannot resume from {path}: it was trained with a global batch of {st['global_batch']} "
                f"examples, this run uses {self.batches.global_batch} (batch_size × processes × grad_accum); "
                f"the data position would not line up")
        saved_mode = st.get("launch", {}).get("mode", "single" if st.get("world", 1) == 1 else "ddp")
        has_ds = (ts / "deepspeed").is_dir()
        if self.mode == "deepspeed" or has_ds:
            if not (self.mode == "deepspeed" and has_ds and st["world"] == self.acc.num_processes):
                raise ValueError(
                    f"cannot resume from {path}: it was written by a {saved_mode} run with {st['world']} processes "
                    f"and this is a {self.mode} run with {self.acc.num_processes}; a DeepSpeed checkpoint holds one "
                    f"optimizer shard per rank and resumes only under DeepSpeed with the same process count "
                    f"(the head in {path} loads anywhere)")
        if self.mode == "deepspeed":
            self.model.load_checkpoint(str(ts / "deepspeed"), tag="engine", load_optimizer_states=True,
                                       load_lr_scheduler_states=False, load_module_strict=True)
        elif self.mode == "fsdp":
            from safetensors.torch import load_file
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            if saved_mode != "fsdp":
                raise ValueError(f"cannot resume {path} (written by a {saved_mode} run) under FSDP: its optimizer "
                                 f"state is keyed differently; relaunch as {saved_mode} or start from its head")
            # rank 0 reads the full state and broadcasts it; the other ranks keep only their shards
            full, osd = {}, {}
            if self.acc.is_main_process:
                full = load_file(str(ts / "draft.safetensors"))
                osd = torch.load(ts / "optimizer.pt", map_location="cpu", weights_only=True)
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, full, options=opts)
            set_optimizer_state_dict(self.model, self._opt(), osd, options=opts)
        else:
            from safetensors.torch import load_file

            if saved_mode == "fsdp":
                raise ValueError(f"cannot resume {path} (written under FSDP) without FSDP: relaunch with "
                                 f"conf/launch/fsdp.yaml, or start from its head")
            try:
                self._unwrapped().load_trainable_state_dict(load_file(str(path / "model.safetensors")))
            except RuntimeError as e:  # "Missing key(s)" / size mismatch: say which head.* setting differs
                raise explain_state_mismatch(path, self.cfg, e) from None
            # map to the CPU: a checkpoint written on cuda:0 must load on a CPU-only machine or on another rank's
            # GPU; load_state_dict moves each state tensor to its parameter's device
            self._opt().load_state_dict(torch.load(ts / "optimizer.pt", map_location="cpu", weights_only=True))
        self.scheduler.load_state_dict(torch.load(ts / "scheduler.pt", map_location="cpu", weights_only=True))
        rng_file = ts / f"rng-rank{self.acc.process_index}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
        self.step = step
        self._resume_tau_best(st, ts)
        if self.metrics_path.is_file() and self.acc.is_main_process:  # drop log lines past the checkpoint
            lines = [ln for ln in self.metrics_path.read_text().splitlines()
                     if ln.strip() and json.loads(ln).get("step", 0) <= step]
            atomic_write_text(self.metrics_path, "\n".join(lines) + ("\n" if lines else ""))
        log.info("resumed from %s at step %d (data position %d)", path, step, step * self.batches.global_batch)
        return True

    # ------------------------------------------------------------------ loop
    def _global_count(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        n = sum(self._unwrapped().num_targets(b) for b in micro)
        n = torch.as_tensor(n, dtype=torch.float64, device=self.acc.device)
        return self.acc.reduce(n, reduction="sum") if self.acc.num_processes > 1 else n

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``accum`` micro-batches; returns reduced metrics."""
        acc = self.acc
        self.model.train()
        micro = [self.collate([self.data[i] for i in idx]) for idx in self.batches.micro_batches(self.step)]
        micro = [{k: v.to(acc.device) for k, v in b.items()} for b in micro]
        denom = self._global_count(micro).clamp(min=1.0)
        # accelerate (DDP, FSDP) / the DeepSpeed engine divide by grad_accum, and DDP's all-reduce, FSDP's
        # reduce-scatter and ZeRO's gradient reduction all average over processes: undo both so the
        # gradient is exactly (sum of token losses in the global batch) / (tokens in the global batch).
        scale = acc.num_processes * self.accum
        sums: dict[str, list[torch.Tensor]] = {}
        loss_sum_total = torch.zeros((), dtype=torch.float64, device=acc.device)
        ntok = 0
        gnorm = None
        for b in micro:
            with acc.accumulate(self.model):
                with self._autocast():
                    loss_sum, stats = self.model(b)
                acc.backward(loss_sum * (scale / denom).to(loss_sum.dtype))
                loss_sum_total += loss_sum.detach().double()
                ntok += int(b["attention_mask"].sum())
                for k, (s, c) in stats.items():
                    pair = sums.setdefault(k, [torch.zeros((), dtype=torch.float64, device=acc.device),
                                               torch.zeros((), dtype=torch.float64, device=acc.device)])
                    pair[0] += s.detach().double()
                    pair[1] += c.detach().double()
                if acc.sync_gradients:
                    if self.mode == "deepspeed":  # the engine clipped and stepped inside backward()
                        gnorm = self.model.get_global_grad_norm()
                    elif self.cfg.optim.max_grad_norm:
                        gnorm = acc.clip_grad_norm_(self.model.parameters(), float(self.cfg.optim.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        keys = sorted(sums)
        vec = torch.stack([loss_sum_total] + [sums[k][0] for k in keys] + [sums[k][1] for k in keys]
                          + [torch.tensor(float(ntok), dtype=torch.float64, device=acc.device)])
        if acc.num_processes > 1:
            vec = acc.reduce(vec, reduction="sum")
        out = {"step": self.step, "loss": float(vec[0] / denom), "lr": self.scheduler.get_last_lr()[0],
               "tokens": float(vec[-1])}
        for i, k in enumerate(keys):
            out[k] = float(vec[1 + i] / vec[1 + len(keys) + i].clamp(min=1))
        if gnorm is not None:
            if hasattr(gnorm, "full_tensor"):  # FSDP2: a DTensor
                gnorm = gnorm.full_tensor()
            out["grad_norm"] = float(gnorm)
        return out

    @torch.no_grad()
    def simulated_tau(self) -> dict[str, float]:
        """Teacher-forced τ on the first ``train.sim_tau_examples`` held-out sequences (cheap, every eval; the
        held-out split comes in hash order (split_conversations), so the first rows are a sample of it).

        What it simulates: greedy speculative decoding with the draft's chain (top-1 at every depth) and,
        if the objective names one, its static tree. At a held-out position t whose next D+1 tokens are the
        target's own greedy continuation (the target's argmax, teacher-forced on the held-out prefix; on
        self-distilled data that is every position), a verification step starting at t accepts exactly the
        drafted tokens that follow the reference, so ``accepted_lengths`` of the draft's candidate ranks is
        what decoding would accept there. τ_sim = 1 + mean accepted over those positions. It weights every
        such position equally, while real decoding starts steps only after accepted runs, and positions
        where the held-out text leaves the greedy path are skipped (``sim_tau/coverage`` = share scored)."""
        obj = self._unwrapped()
        n_rows = min(len(self.heldout) if self.heldout is not None else 0,
                     int(self.cfg.train.get("sim_tau_examples", 0) or 0))
        if n_rows == 0 or not hasattr(obj, "acceptance_ranks"):
            return {}
        paths = obj.sim_tree_paths() if hasattr(obj, "sim_tree_paths") else None
        acc = self.acc
        was = obj.training
        obj.train(False)
        totals: torch.Tensor | None = None
        with self._full_draft(), self._autocast():
            for idx, counted in lockstep_batches(n_rows, 4, acc):
                b = {k: v.to(acc.device) for k, v in self.heldout_collate([self.heldout[i] for i in idx]).items()}
                ranks, considered = obj.acceptance_ranks(b)
                ranks = ranks.cpu()
                D = ranks.shape[1]
                chain = accepted_lengths(ranks)
                tree = accepted_lengths(ranks, paths) if paths is not None else chain
                per_depth = torch.stack([(chain >= d).sum() for d in range(1, D + 1)]).double()
                row = torch.cat([torch.tensor([ranks.shape[0], float(considered), chain.sum(), tree.sum()],
                                              dtype=torch.float64), per_depth])
                row = row if counted else torch.zeros_like(row)
                totals = row if totals is None else totals + row
        obj.train(was)
        assert totals is not None
        if acc.num_processes > 1:
            totals = acc.reduce(totals.to(acc.device), reduction="sum").cpu()
        n = float(totals[0])
        if n == 0:
            return {"sim_tau/positions": 0.0}
        out = {"sim_tau/chain": 1 + float(totals[2]) / n, "sim_tau/positions": n,
               "sim_tau/coverage": n / max(float(totals[1]), 1.0)}
        if paths is not None:
            out["sim_tau/tree"] = 1 + float(totals[3]) / n
        for d in range(len(totals) - 4):
            out[f"sim_accept/chain@{d + 1}"] = float(totals[4 + d]) / n
        return out

    def _eval_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.evaluate is not None:
            with self._full_draft():
                out.update(self.evaluate(self.step))
        out.update(self.simulated_tau())
        return out

    # ------------------------------------------------------------------ measured τ, best/ (train.tau_eval)
    def _init_tau_eval(self, tau_eval: Callable[[int, Path], dict[str, Any]] | None) -> None:
        """``train.tau_eval.every`` > 0 with an evaluator (``build_tau_evaluator``): measure τ every N steps and at
        the end, keep ``best/``. The evaluator runs on rank 0 alone, so the frozen target must be whole there."""
        self.tau_eval = tau_eval
        self.tau_every = tau_every(self.cfg) if tau_eval is not None else 0
        self.tau_best: dict[str, Any] | None = None  # {"step", "tau"} of best/; saved in every checkpoint
        if self.tau_every > 0 and self.target_sharding is not None:
            raise ValueError("train.tau_eval.every > 0 decodes with the frozen target on rank 0 alone, but this launch "
                             "shards it (train.shard_target): set train.shard_target=false or train.tau_eval.every=0")

    def measure_tau(self) -> dict[str, Any]:
        """Write the current head (gathered on rank 0 in every launch mode), measure τ on rank 0 while the other
        ranks wait, and copy the head into ``best/`` when its τ beats the best so far (a tie keeps the earlier).
        Returns ``tau_eval/*`` metrics, the same on every rank."""
        acc = self.acc
        cand = self.out_dir / ".tau-candidate"
        if acc.is_main_process:
            shutil.rmtree(cand, ignore_errors=True)
        acc.wait_for_everyone()
        self._write_head(cand, {**self.extra, "step": self.step})
        acc.wait_for_everyone()
        out: dict[str, Any] = {}
        if acc.is_main_process:
            assert self.tau_eval is not None
            devices = [acc.device] if acc.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):  # loading the head draws init numbers: not from training's
                m = self.tau_eval(self.step, cand)
            tau = float(m["tau"])
            if int(m.get("turns", 1)) > 0 and (self.tau_best is None or tau > float(self.tau_best["tau"])):
                self.tau_best = {"step": self.step, "tau": tau}
                with atomic_dir(self.out_dir / "best") as tmp:
                    for f in ("config.json", "model.safetensors"):
                        shutil.copy2(cand / f, tmp / f)
                    (tmp / "best.json").write_text(json.dumps(
                        {**self.tau_best, "selected_by": "measured tau (train.tau_eval, greedy)", "metrics": m},
                        indent=2))
            shutil.rmtree(cand, ignore_errors=True)
            out = {f"tau_eval/{k}": v for k, v in m.items()}
            if self.tau_best is not None:
                out["tau_eval/best_tau"], out["tau_eval/best_step"] = self.tau_best["tau"], self.tau_best["step"]
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            box = broadcast_object_list([out, self.tau_best], from_process=0)
            out, self.tau_best = box[0], box[1]
        return out

    def _save_tau_best(self, ts: Path) -> None:
        """Rank 0: ``trainer_state/tau_best/`` holds best/'s files as of this checkpoint (hard links: no copy), so a
        resume can put back the best/ this checkpoint knew, even if a later step had replaced it."""
        best = self.out_dir / "best"
        if self.tau_best is None or not (best / "best.json").is_file():
            return
        (ts / "tau_best").mkdir()
        for f in ("config.json", "model.safetensors", "best.json"):
            try:
                os.link(best / f, ts / "tau_best" / f)
            except OSError:  # another filesystem or no hard links
                shutil.copy2(best / f, ts / "tau_best" / f)

    def _resume_tau_best(self, st: dict[str, Any], ts: Path) -> None:
        """Take the best-τ bookkeeping from the checkpoint, and make best/ agree with it: a best/ written after the
        checkpoint (the job died later) is replaced by the checkpoint's copy, or removed if it had none."""
        self.tau_best = st.get("tau_best")
        if self.tau_every <= 0 or not self.acc.is_main_process:
            return
        best = self.out_dir / "best"
        on_disk = json.loads((best / "best.json").read_text()) if (best / "best.json").is_file() else None
        want = self.tau_best
        if on_disk is not None and want is not None and int(on_disk["step"]) == int(want["step"]):
            return
        if want is None:
            shutil.rmtree(best, ignore_errors=True)
        elif (ts / "tau_best" / "best.json").is_file():
            with atomic_dir(best) as tmp:
                for f in ("config.json", "model.safetensors", "best.json"):
                    shutil.copy2(ts / "tau_best" / f, tmp / f)
        else:
            raise ValueError(f"cannot resume the best-τ bookkeeping: {ts / 'state.json'} names step {want['step']} "
                             f"(τ {want['tau']}) as best, but {ts / 'tau_best'} is missing")
        log.info("best/ set back to the checkpoint's: %s", want)

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train until max_steps (or ``stop_after`` more steps, for tests); save on schedule and at the end."""
        from tqdm.auto import tqdm

        acc, t = self.acc, self.cfg.train
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if t.resume:
            self.try_resume()
        wandb_run = self._init_wandb()
        reset = _reset_peak_rss()
        bar = tqdm(total=self.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not acc.is_main_process, mininterval=1.0)
        t0, tokens = time.perf_counter(), 0.0
        start_step = self.step
        last = self.step + stop_after if stop_after is not None else self.max_steps
        window: list[dict[str, float]] = []
        while self.step < min(last, self.max_steps):
            m = self.train_step()
            tokens += m["tokens"]
            window.append(m)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            ev = int(t.get("eval_every") or 0)
            eval_now = ev > 0 and self.step % ev == 0 and self.step < self.max_steps
            tau_now = self.tau_every > 0 and self.step % self.tau_every == 0 and self.step < self.max_steps
            # an eval step always writes a row, so eval_every need not be a multiple of log_every
            if self.step % int(t.log_every) == 0 or self.step == self.max_steps or eval_now or tau_now:
                row = {k: float(np.mean([w[k] for w in window if k in w])) for k in window[-1]}
                row["step"] = self.step
                row["epoch"] = round(self.batches.epoch_of(self.step), 4)
                elapsed = max(time.perf_counter() - t0, 1e-9)
                row["tokens_per_s"] = tokens / elapsed
                row["steps_per_s"] = (self.step - start_step) / elapsed
                if eval_now or tau_now:  # a τ step refreshes the held-out metrics first: what they put in the
                    row.update(self._eval_metrics())  # head file (Medusa's tuned tree) is what final/ would carry
                if tau_now:
                    row.update(self.measure_tau())
                window = []
                self.history.append(row)
                if acc.is_main_process:
                    with open(self.metrics_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    if wandb_run is not None:
                        wandb_run.log(row, step=self.step)
            if int(t.save_every) > 0 and self.step % int(t.save_every) == 0 and self.step < self.max_steps:
                self.save_checkpoint()
        bar.close()
        elapsed = time.perf_counter() - t0
        if self.step == self.max_steps:
            final_eval = self._eval_metrics()
            if self.tau_every > 0:  # the final head is always a best/ candidate, measured like the others
                final_eval.update(self.measure_tau())
            if final_eval:
                if self.history:
                    self.history[-1].update(final_eval)
                if acc.is_main_process:
                    with open(self.metrics_path, "a") as f:
                        f.write(json.dumps({"step": self.step, **final_eval}) + "\n")
                    if wandb_run is not None:
                        wandb_run.log(final_eval, step=self.step)
        ckpt = self.save_checkpoint()
        final_dir = self.out_dir / "final"
        if acc.is_main_process and self.step == self.max_steps:
            with atomic_dir(final_dir) as tmp:
                for f in ("config.json", "model.safetensors"):
                    shutil.copy2(ckpt / f, tmp / f)
            self._plot()
        rss = torch.tensor([_peak_rss_mb(), _vm_hwm_mb() if reset else _peak_rss_mb()], dtype=torch.float64,
                           device=acc.device)
        rss_all = acc.gather(rss).reshape(-1, 2).cpu() if acc.num_processes > 1 else rss.reshape(1, 2).cpu()
        acc.wait_for_everyone()
        steps_done = self.step - start_step
        result = TrainResult(self.out_dir, final_dir, self.step, self.history, elapsed,
                             tokens / max(elapsed, 1e-9), _peak_rss_mb(), steps_per_s=steps_done / max(elapsed, 1e-9),
                             launch=self.launch, peak_memory_mb_per_rank=rss_all[:, 0].tolist(),
                             peak_loop_memory_mb_per_rank=rss_all[:, 1].tolist(),
                             trainable_params=self.trainable_params, tau_best=self.tau_best)
        if acc.is_main_process and self.step == self.max_steps:
            result.eval = run_eval_after(self.cfg, final_dir, self.out_dir)
            if result.eval is not None and wandb_run is not None:
                wandb_run.log({f"eval/{k}": v for k, v in result.eval.items() if isinstance(v, (int, float))},
                              step=self.step)
        if acc.is_main_process:
            atomic_write_text(self.out_dir / "run_info.json", json.dumps(
                {"steps": self.step, "seconds": round(elapsed, 3), "tokens_per_s": round(result.tokens_per_s, 2),
                 **result.summary_fields()}, indent=2))
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in result.summary_fields().items() if k != "eval"})
            wandb_run.finish()
        return result

    # ------------------------------------------------------------------ logging
    def _init_wandb(self):
        lg = self.cfg.logging
        if lg.wandb not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb must be offline, online or disabled, got {lg.wandb!r}")
        if not self.acc.is_main_process or lg.wandb == "disabled":
            return None
        import wandb
        from omegaconf import OmegaConf

        os.environ.setdefault("WANDB_SILENT", "true")
        config = OmegaConf.to_container(self.cfg, resolve=True)
        config["launch"] = self.launch
        return wandb.init(project=lg.project, name=self.cfg.run_name, mode=lg.wandb, dir=str(self.out_dir),
                          config=config, resume="allow",
                          id=f"{self.cfg.run_name}".replace("/", "-")[:64] if lg.wandb == "online" else None)

    def _plot(self) -> None:
        if not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history]
        acc_keys = sorted(k for k in self.history[-1] if k.startswith("top1/"))
        taus = [(r["step"], r["tau_eval/tau"]) for r in self.history if "tau_eval/tau" in r]
        fig, axes = plt.subplots(1, 3 if taus else 2, figsize=(15 if taus else 10, 3.5))
        if taus:  # train.tau_eval: measured τ per evaluation, best/'s step marked
            axes[2].plot([x for x, _ in taus], [y for _, y in taus], marker="o")
            if self.tau_best is not None:
                axes[2].axvline(self.tau_best["step"], color="gray", linestyle=":",
                                label=f"best/ (step {self.tau_best['step']})")
                axes[2].legend(fontsize=7)
            axes[2].set_xlabel("step"), axes[2].set_ylabel("τ (greedy)")
            axes[2].set_title("measured τ, held-out prompts")
        axes[0].plot(steps, [r["loss"] for r in self.history])
        axes[0].set_xlabel("step"), axes[0].set_ylabel("loss"), axes[0].set_title("training loss")
        for k in acc_keys:
            axes[1].plot(steps, [r.get(k, float("nan")) for r in self.history], label=k)
        axes[1].set_xlabel("step"), axes[1].set_ylabel("top-1 accuracy"), axes[1].set_title("per-head accuracy")
        if acc_keys:
            axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.out_dir / "training.png", dpi=110)
        plt.close(fig)


# ------------------------------------------------------------------------------------------
# Measured τ during training (train.tau_eval): the evaluator comes from config, not from an import
# ------------------------------------------------------------------------------------------

def tau_every(cfg: Any) -> int:
    """``train.tau_eval.every`` checked: steps between measured-τ evaluations, 0 = off."""
    te = cfg.train.get("tau_eval")
    every = 0 if te is None else te.get("every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"train.tau_eval.every must be a whole number of steps >= 0 (0: off), got {every!r}")
    return every


def build_tau_evaluator(cfg: Any, target: Any, data: Any) -> Callable[[int, Path], dict[str, Any]] | None:
    """The periodic evaluator ``train.tau_eval.evaluator`` names (``_target_``, instantiated here, so the
    implementation - pipeline/tau_eval.py, which uses eval/ - is imported through config, never by train/),
    given the run's frozen target and the prepared data's held-out questions. None when ``every`` is 0."""
    if tau_every(cfg) == 0:
        return None
    spec = cfg.train.tau_eval.get("evaluator")
    if spec is None or "_target_" not in spec:
        raise ValueError("train.tau_eval.every > 0 needs train.tau_eval.evaluator._target_ (e.g. "
                         "pipeline.tau_eval.TauEvaluator)")
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(spec, target=target, questions=str(data.heldout_questions),
                           chat_template=cfg.data.get("chat_template"))
    except InstantiationException as e:  # a bad setting: the evaluator's own ValueError, which names the key
        if isinstance(e.__cause__, ValueError):
            raise e.__cause__ from None
        raise


# ------------------------------------------------------------------------------------------
# Evaluate after training (one sweep job = train + eval)
# ------------------------------------------------------------------------------------------

def run_eval_after(cfg: Any, final_dir: Path, out_dir: Path) -> dict[str, Any] | None:
    """``train.eval_after.enabled``: the runner ``train.eval_after._target_`` names (pipeline/eval_after.py: eval/
    acceptance.py on the final head, writing out_dir/eval.json; rank 0), instantiated with the other fields."""
    ea = cfg.train.get("eval_after")
    if ea is None or not bool(ea.get("enabled", False)):
        return None
    from omegaconf import OmegaConf

    spec = {k: v for k, v in OmegaConf.to_container(ea, resolve=True).items() if k != "enabled"}
    if "_target_" not in spec:
        raise ValueError("train.eval_after.enabled=true needs train.eval_after._target_ (e.g. "
                         "pipeline.eval_after.EvalAfter)")
    from hydra.utils import instantiate

    return instantiate(spec)(cfg, final_dir, out_dir)


# ------------------------------------------------------------------------------------------
# Setup helpers used by every entry
# ------------------------------------------------------------------------------------------

def resolve_out_dir(cfg: Any) -> Path:
    """One output directory for all ranks: cfg.out_dir, else Hydra's job dir, else runs/<run_name>.

    Hydra's run dir is ``runs/<run_name>`` (no timestamp), so every process of a multi-process launch
    resolves the same path; in a sweep each job gets its own numbered subdirectory
    (``runs/sweeps/<run_name>/<job>``), the same on every rank because each rank runs the jobs in order.
    """
    if cfg.get("out_dir"):
        return Path(cfg.out_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:  # pragma: no cover
        pass
    return Path("runs") / str(cfg.run_name)


def write_summary(acc: Any, out_dir: Path, family: str, result: TrainResult, **fields: Any) -> dict[str, Any]:
    """An entry's summary.json (rank 0 writes it, every rank returns it): ``family``, the family's own ``fields``
    (feature source, draft vocabulary, ...), what ran and how fast, the scale-out fields every family carries
    (``TrainResult.summary_fields``) and the loss curve. ``peak_rss_loop_mb`` is rank 0's peak RSS during fit()
    (the loop's measure; scripts/bench_features.py reads it). Being every entry's last call, it also ends a
    multi-process run: all ranks meet, then the process group is destroyed."""
    loop_peak = result.peak_loop_memory_mb_per_rank
    summary = {"family": family, **fields, "out_dir": str(out_dir), "final": str(result.final_dir),
               "steps": result.steps, "seconds": round(result.seconds, 1),
               "train_tokens_per_s": round(result.tokens_per_s, 1), "peak_rss_mb": round(result.peak_memory_mb, 1),
               "peak_rss_loop_mb": round(loop_peak[0], 1) if loop_peak else None, **result.summary_fields(),
               "losses": [round(r["loss"], 6) for r in result.history if "loss" in r],
               "last": result.history[-1] if result.history else {}}
    if acc.is_main_process:
        atomic_write_text(Path(out_dir) / "summary.json", json.dumps(summary, indent=2))
        log.info("done: %s", json.dumps(summary))
    if acc.num_processes > 1:
        # Tear the process group down before the interpreter exits: left to atexit, a gloo rank can abort with
        # "terminate called without an active exception" after a finished run, failing the whole launch.
        acc.wait_for_everyone()
        acc.end_training()
    return summary


def save_run_config(cfg: Any, out_dir: Path) -> None:
    from omegaconf import OmegaConf

    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
