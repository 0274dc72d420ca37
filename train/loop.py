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
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from heads.checkpoint import atomic_dir, atomic_write_text

from train.batching import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    GlobalBatches, lr_lambda, lockstep_batches)
from train.distributed import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    launch_mode, zero_stage, resolve_mixed_precision, make_accelerator, launch_info, _device_mesh, _plain_copy,
    shard_frozen_target, _safe_deepspeed_checkpoint_engine)
from train.sim_tau import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    greedy_windows, reference_ranks, accepted_lengths)
from train.checkpointing import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    rng_state, set_rng_state, list_checkpoints)
from train.run import (  # noqa: F401 (also re-exported: entries and tests import from train.loop)
    TrainResult, _peak_rss_mb, _reset_peak_rss, _vm_hwm_mb, tau_every, build_tau_evaluator, run_eval_after,
    resolve_out_dir, write_summary, save_run_config)

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------

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
