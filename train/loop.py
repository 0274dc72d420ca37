"""The training loop every head family shares: accelerate devices/processes, deterministic data
order, AdamW + warmup/cosine, accumulation, clipping, logging, atomic checkpoints, exact resume.

A family plugs in an *objective*: an ``nn.Module`` that owns the draft (registered, trainable) and
holds the frozen target unregistered (so DDP/DeepSpeed never see its parameters), and whose
``forward(batch)`` returns ``(loss_sum, stats)``: the loss summed over this micro-batch's valid
tokens, and a dict ``name -> (sum, count)`` of tensors for logging. The loop divides by the number
of valid tokens in the *global* batch (all micro-batches of all processes in one optimizer step),
so 1 process × batch 2B and 2 processes × batch B give the same update. An objective that draws random choices
per row (the block draft's anchors) may define ``begin_step(step)``: the loop calls it before every optimizer step,
so the draws can depend on (seed, step, row) and not on the launch topology, the padding or the RNG's history.

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
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from draftheads.heads.checkpoint import atomic_dir, atomic_write_text

from draftheads.train.batching import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    GlobalBatches, lr_lambda, lockstep_batches)
from draftheads.train.distributed import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    launch_mode, zero_stage, resolve_mixed_precision, make_accelerator, launch_info, _device_mesh, _plain_copy,
    shard_frozen_target, _safe_deepspeed_checkpoint_engine)
from draftheads.train.sim_tau import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    greedy_windows, reference_ranks, accepted_lengths)
from draftheads.train.checkpointing import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    CheckpointMixin, rng_state, set_rng_state, list_checkpoints)
from draftheads.train.reporting import ReportMixin
from draftheads.train.tau_select import TauMixin
from draftheads.train.run import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    TrainResult, _peak_rss_mb, _reset_peak_rss, _vm_hwm_mb, tau_every, build_tau_evaluator, run_eval_after,
    resolve_out_dir, write_summary, save_run_config)

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------

class Trainer(CheckpointMixin, TauMixin, ReportMixin):
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
        if not float(o.lr) > 0:  # also checked at composition (heads/schema.py RANGES); here for compose() callers
            raise ValueError(f"optim.lr={o.lr} is not allowed: a learning rate must be > 0 (0 trains nothing)")
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

    def _finished_earlier(self) -> bool:
        """Whether a resumed run had already reached max_steps and written final/ and its summary.json: then there is
        nothing to train, measure or save, and redoing the final evaluation would append a second row for the last
        step (and a τ measurement, a minute or more) and replace the summary of the run that trained with an empty
        one. A run killed between its last checkpoint and its summary still finishes normally."""
        summary = self.out_dir / "summary.json"
        if self.step != self.max_steps or not (self.out_dir / "final" / "model.safetensors").is_file() or \
                not summary.is_file():
            return False
        try:
            done = json.loads(summary.read_text()).get("steps") == self.max_steps
        except (OSError, json.JSONDecodeError):
            return False
        if done:
            log.info("%s finished earlier at step %d (final/ and summary.json are there): nothing to train or measure; "
                     "raise train.max_steps to continue it", self.out_dir, self.step)
        return done

    def _start_over(self, overwrite: bool) -> None:
        """A fresh start writes its own metrics rows; with ``train.overwrite`` an earlier run's checkpoints and
        best/ go first (resolve_out_dir refused the folder otherwise)."""
        from draftheads.train.resume import trim_metrics

        if overwrite:
            gone = [self.out_dir / n for n in ("checkpoints", "best") if (self.out_dir / n).exists()]
            if gone or self.metrics_path.is_file():
                log.warning("train.overwrite=true: removing the earlier run's %s and the rows of %s (nothing else "
                            "in %s is touched)", ", ".join(map(str, gone)) or "(no checkpoints)", self.metrics_path,
                            self.out_dir)
            for p in gone:
                shutil.rmtree(p)
        trim_metrics(self.metrics_path, 0)

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
        begin_step = getattr(self._unwrapped(), "begin_step", None)
        if begin_step is not None:
            begin_step(self.step)
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

    def _log_row(self, row: dict[str, Any], wandb_run: Any) -> None:
        """Rank 0: one metrics.jsonl line (and a wandb log at the row's step)."""
        if not self.acc.is_main_process:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if wandb_run is not None:
            wandb_run.log(row, step=row["step"])

    def fit(self, stop_after: int | None = None) -> TrainResult:
        """Train until max_steps (or ``stop_after`` more steps, for tests); save on schedule and at the end."""
        from tqdm.auto import tqdm

        acc, t = self.acc, self.cfg.train
        if acc.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        if t.resume:
            self.try_resume()
        elif self.step == 0 and acc.is_main_process:
            self._start_over(bool(t.get("overwrite")))
        acc.wait_for_everyone()
        if t.resume and self._finished_earlier():
            return TrainResult(self.out_dir, self.out_dir / "final", self.step, [], 0.0, 0.0, _peak_rss_mb(),
                               launch=self.launch, trainable_params=self.trainable_params, tau_best=self.tau_best,
                               start_step=self.step, finished_earlier=True)
        wandb_run = self._init_wandb()
        reset = _reset_peak_rss()
        bar = tqdm(total=self.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not acc.is_main_process, mininterval=1.0)
        t0, tokens = time.perf_counter(), 0.0
        start_step = self.step
        last = self.step + stop_after if stop_after is not None else self.max_steps
        if self.step == 0 and self.tau_at_start():  # the starting head is a best/ candidate too
            row = {"step": 0, "epoch": 0.0, **self._eval_metrics(), **self.measure_tau()}
            self.history.append(row)
            self._log_row(row, wandb_run)
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
                self._log_row(row, wandb_run)
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
                self._log_row({"step": self.step, **final_eval}, wandb_run)
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
                             trainable_params=self.trainable_params, tau_best=self.tau_best, start_step=start_step)
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
