"""Checkpoint layout and RNG state: ``step-N/`` directories and everything an exact resume restores
besides weights and optimizer (see ``Trainer.save_checkpoint`` / ``try_resume``)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftheads.heads.checkpoint import save_torch

log = logging.getLogger(__name__)

CKPT_RE = re.compile(r"^step-(\d+)$")


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
# Saving and resuming the trainer (a part of ``train.loop.Trainer``)
# ------------------------------------------------------------------------------------------

class CheckpointMixin:
    """``Trainer``'s checkpoints: a loadable head gathered on rank 0 plus ``trainer_state/`` for an exact resume,
    in every launch mode (single, DDP, DeepSpeed ZeRO, FSDP)."""

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
                from draftheads.heads.checkpoint import save_safetensors  # the umask's mode, not safetensors' 0600

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
        save_torch(rng_state(), ts / f"rng-rank{acc.process_index}.pt")
        if self.mode == "deepspeed":
            self.model.save_checkpoint(str(ts / "deepspeed"), tag="engine", client_state={}, save_latest=False)
        elif self.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            osd = get_optimizer_state_dict(self.model, self._opt(),
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if acc.is_main_process:
                save_torch(osd, ts / "optimizer.pt")
        elif acc.is_main_process:
            save_torch(self._opt().state_dict(), ts / "optimizer.pt")
        if acc.is_main_process:
            save_torch(self.scheduler.state_dict(), ts / "scheduler.pt")
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
        from draftheads.train.resume import check_same_data, explain_state_mismatch, pick_checkpoint, trim_metrics

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
        if self.acc.is_main_process:
            trim_metrics(self.metrics_path, step)  # drop log lines past the checkpoint
        log.info("resumed from %s at step %d (data position %d)", path, step, step * self.batches.global_batch)
        return True
