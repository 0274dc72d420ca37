"""The training loop every head family shares: accelerate devices/processes, deterministic data
order, AdamW + warmup/cosine, accumulation, clipping, logging, atomic checkpoints, exact resume.

A family plugs in an *objective*: an ``nn.Module`` that owns the draft (registered, trainable) and
holds the frozen target unregistered (so DDP/DeepSpeed never see its parameters), and whose
``forward(batch)`` returns ``(loss_sum, stats)``: the loss summed over this micro-batch's valid
tokens, and a dict ``name -> (sum, count)`` of tensors for logging. The loop divides by the number
of valid tokens in the *global* batch (all micro-batches of all processes in one optimizer step),
so 1 process × batch 2B and 2 processes × batch B give the same update.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
from torch import nn

from heads.checkpoint import atomic_dir, atomic_write_text

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
    """Complete checkpoints (temp dirs start with '.' and are ignored), oldest first."""
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


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Trainer:
    """Runs the loop for one objective. Construct, then ``fit()``."""

    def __init__(self, cfg: Any, accelerator: Any, objective: nn.Module, train_data: Any, collate: Callable,
                 out_dir: Path, checkpoint_extra: dict[str, Any] | None = None,
                 evaluate: Callable[[int], dict] | None = None):
        self.cfg = cfg
        self.acc = accelerator
        self.objective = objective
        self.data = train_data
        self.collate = collate
        self.out_dir = Path(out_dir)
        self.extra = checkpoint_extra or {}
        self.evaluate = evaluate  # held-out metrics every train.eval_every steps and before the final save
        t, o = cfg.train, cfg.optim
        self.max_steps = int(t.max_steps)
        self.accum = int(t.grad_accum)
        params = [p for p in objective.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the draft has no trainable parameters")
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": float(o.weight_decay)},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=float(o.lr), betas=tuple(o.betas), eps=float(o.eps))
        warmup = int(o.warmup_steps) if o.warmup_steps is not None else int(o.warmup_ratio * self.max_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(warmup, self.max_steps, float(o.min_lr_ratio), o.schedule))
        self.model, self.optimizer = self.acc.prepare(self.objective, self.optimizer)
        self.batches = GlobalBatches(
            [len(x) for x in train_data["input_ids"]], int(t.batch_size), self.acc.num_processes,
            self.acc.process_index, self.accum, int(t.seed), bool(t.group_by_length))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.metrics_path = self.out_dir / "metrics.jsonl"

    # ------------------------------------------------------------------ state
    def _unwrapped(self) -> nn.Module:
        return self.acc.unwrap_model(self.model)

    def save_checkpoint(self) -> Path:
        """step-N/ = a loadable head checkpoint + trainer_state/ (optimizer, scheduler, RNG, step)."""
        acc = self.acc
        root = self.out_dir / "checkpoints"
        final_dir = root / f"step-{self.step:06d}"
        tmp = root / f".step-{self.step:06d}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            self._unwrapped().save_pretrained(tmp, extra={**self.extra, "step": self.step})  # creates tmp
            (tmp / "trainer_state").mkdir()
        acc.wait_for_everyone()
        # Every rank saves its own RNG state: noise/dropout streams differ per rank.
        torch.save(rng_state(), tmp / "trainer_state" / f"rng-rank{acc.process_index}.pt")
        if acc.is_main_process:
            torch.save(self.optimizer.optimizer.state_dict() if hasattr(self.optimizer, "optimizer")
                       else self.optimizer.state_dict(), tmp / "trainer_state" / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "trainer_state" / "scheduler.pt")
        acc.wait_for_everyone()
        if acc.is_main_process:
            (tmp / "trainer_state" / "state.json").write_text(json.dumps({
                "step": self.step, "global_batch": self.batches.global_batch, "world": acc.num_processes,
                "seed": int(self.cfg.train.seed), "max_steps": self.max_steps}))
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
        ckpts = list_checkpoints(self.out_dir)
        if not ckpts:
            log.info("resume requested but no checkpoint in %s: starting fresh", self.out_dir / "checkpoints")
            return False
        step, path = ckpts[-1]
        st = json.loads((path / "trainer_state" / "state.json").read_text())
        if st["global_batch"] != self.batches.global_batch:
            raise ValueError(
                f"cannot resume from {path}: it was trained with a global batch of {st['global_batch']} "
                f"examples, this run uses {self.batches.global_batch} (batch_size × processes × grad_accum); "
                f"the data position would not line up")
        from safetensors.torch import load_file

        state = load_file(str(path / "model.safetensors"))
        self._unwrapped().load_trainable_state_dict(state)
        opt = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        opt.load_state_dict(torch.load(path / "trainer_state" / "optimizer.pt", weights_only=True))
        self.scheduler.load_state_dict(torch.load(path / "trainer_state" / "scheduler.pt", weights_only=True))
        rng_file = path / "trainer_state" / f"rng-rank{self.acc.process_index}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))
        self.step = step
        if self.metrics_path.is_file() and self.acc.is_main_process:  # drop log lines past the checkpoint
            lines = [ln for ln in self.metrics_path.read_text().splitlines()
                     if ln.strip() and json.loads(ln).get("step", 0) <= step]
            atomic_write_text(self.metrics_path, "\n".join(lines) + ("\n" if lines else ""))
        log.info("resumed from %s at step %d", path, step)
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
        # accelerate/DeepSpeed divide by grad_accum and DDP averages over processes: undo both so the
        # gradient is exactly (sum of token losses in the global batch) / (tokens in the global batch).
        scale = acc.num_processes * self.accum
        sums: dict[str, list[torch.Tensor]] = {}
        loss_sum_total = torch.zeros((), dtype=torch.float64, device=acc.device)
        ntok = 0
        gnorm = None
        for b in micro:
            with acc.accumulate(self.model):
                with acc.autocast():
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
                    gnorm = acc.clip_grad_norm_(self.model.parameters(), float(self.cfg.optim.max_grad_norm)) \
                        if self.cfg.optim.max_grad_norm else None
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
            out["grad_norm"] = float(gnorm)
        return out

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train until max_steps (or ``stop_after`` more steps, for tests); save on schedule and at the end."""
        from tqdm.auto import tqdm

        acc, t = self.acc, self.cfg.train
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if t.resume:
            self.try_resume()
        wandb_run = self._init_wandb()
        bar = tqdm(total=self.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not acc.is_main_process, mininterval=1.0)
        t0, tokens = time.perf_counter(), 0.0
        last = self.step + stop_after if stop_after is not None else self.max_steps
        window: list[dict[str, float]] = []
        while self.step < min(last, self.max_steps):
            m = self.train_step()
            tokens += m["tokens"]
            window.append(m)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            if self.step % int(t.log_every) == 0 or self.step == self.max_steps:
                row = {k: float(np.mean([w[k] for w in window if k in w])) for k in window[-1]}
                row["step"] = self.step
                row["epoch"] = round(self.batches.epoch_of(self.step), 4)
                row["tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
                ev = int(t.get("eval_every") or 0)
                if self.evaluate is not None and ev > 0 and self.step % ev == 0 and self.step < self.max_steps:
                    row.update(self.evaluate(self.step))
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
        if self.evaluate is not None and self.step == self.max_steps:
            final_eval = self.evaluate(self.step)
            if self.history:
                self.history[-1].update(final_eval)
            if acc.is_main_process:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps({"step": self.step, **final_eval}) + "\n")
        ckpt = self.save_checkpoint()
        final_dir = self.out_dir / "final"
        if acc.is_main_process and self.step == self.max_steps:
            with atomic_dir(final_dir) as tmp:
                for f in ("config.json", "model.safetensors"):
                    shutil.copy2(ckpt / f, tmp / f)
            self._plot()
        acc.wait_for_everyone()
        if wandb_run is not None:
            wandb_run.finish()
        return TrainResult(self.out_dir, final_dir, self.step, self.history, elapsed,
                           tokens / max(elapsed, 1e-9), _peak_rss_mb())

    # ------------------------------------------------------------------ logging
    def _init_wandb(self):
        lg = self.cfg.logging
        if not self.acc.is_main_process or lg.wandb == "disabled":
            return None
        if lg.wandb not in ("offline", "online"):
            raise ValueError(f"logging.wandb must be offline, online or disabled, got {lg.wandb!r}")
        import wandb
        from omegaconf import OmegaConf

        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(project=lg.project, name=self.cfg.run_name, mode=lg.wandb, dir=str(self.out_dir),
                          config=OmegaConf.to_container(self.cfg, resolve=True), resume="allow",
                          id=f"{self.cfg.run_name}".replace("/", "-")[:64] if lg.wandb == "online" else None)

    def _plot(self) -> None:
        if not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.history]
        acc_keys = sorted(k for k in self.history[-1] if k.startswith("top1/"))
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
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
# Setup helpers used by every entry
# ------------------------------------------------------------------------------------------

def make_accelerator(cfg: Any):
    """An Accelerator for the configured device and precision (CPU needs cpu=True to form a process group)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    t = cfg.train
    device = t.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"train.device must be auto, cpu or cuda, got {device!r}")
    mp = t.mixed_precision
    if mp not in ("no", "bf16", "fp16"):
        raise ValueError(f"train.mixed_precision must be no, bf16 or fp16, got {mp!r}")
    acc = Accelerator(cpu=device == "cpu", mixed_precision=mp, gradient_accumulation_steps=int(t.grad_accum))
    set_seed(int(t.seed))
    return acc


def resolve_out_dir(cfg: Any) -> Path:
    """One output directory for all ranks: cfg.out_dir, else Hydra's job dir, else runs/<run_name>.

    Hydra's run dir is ``runs/<run_name>`` (no timestamp), so every process of a multi-process launch
    resolves the same path; in a sweep each job gets its own numbered subdirectory.
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


def save_run_config(cfg: Any, out_dir: Path) -> None:
    from omegaconf import OmegaConf

    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
