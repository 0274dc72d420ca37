"""What a training entry does around the loop: output folder and run config, the τ evaluator and the
eval after training (both built from config: train/ never imports eval/), the result and its summary."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from draftheads.heads.checkpoint import atomic_write_text

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# The result of a run
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
    start_step: int = 0  # the step this process began at (> 0 when resumed): seconds and losses cover only its steps
    finished_earlier: bool = False  # resumed a run that had already finished: nothing ran, its summary.json stands

    def summary_fields(self) -> dict[str, Any]:
        """What every family's summary.json carries about scale-out (the sweep report reads these)."""
        return {"launch": self.launch, "steps_per_s": round(self.steps_per_s, 4),
                "trainable_params": self.trainable_params,
                "peak_rss_mb_per_rank": [round(x, 1) for x in self.peak_memory_mb_per_rank],
                "peak_rss_loop_mb_per_rank": [round(x, 1) for x in self.peak_loop_memory_mb_per_rank],
                "eval": self.eval, "tau_best": self.tau_best, "resumed_from_step": self.start_step}


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
    Every entry calls this first, so it is also where a folder holding an earlier run is refused (below) and
    where rank 0 takes the folder's lock (heads/outputs.py) for the rest of the job.
    """
    if cfg.get("out_dir"):
        out = Path(cfg.out_dir)
    else:
        out = Path("runs") / str(cfg.run_name)
        try:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                out = Path(HydraConfig.get().runtime.output_dir)
        except ImportError:  # pragma: no cover
            pass
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={out} is a file, not a folder: choose a folder path (a new one, or an earlier run "
                         f"to continue with train.resume=true)")
    refuse_silent_restart(cfg, out)
    from draftheads.heads.job import launch_rank
    from draftheads.heads.outputs import claim

    if launch_rank()[0] == 0:  # one writer per run folder: a second training into it gets one line and exit 2
        claim(out, "training")
    return out


def refuse_silent_restart(cfg: Any, out_dir: Path) -> None:
    """A fresh start in a folder that holds an earlier run's checkpoints would mix the two runs: its
    metrics rows, its ``best/`` (kept by τ) and, through ``keep_last``, prune the new run's own checkpoints.
    Rerunning a training command without ``train.resume=true`` is the usual way to get there, so it is an
    error naming both ways out (``train.overwrite=true`` removes the earlier run's files first)."""
    from draftheads.train.checkpointing import list_checkpoints

    t = cfg.train
    if t.get("resume") or t.get("overwrite"):
        return
    ckpts = list_checkpoints(out_dir)
    if ckpts:
        raise ValueError(
            f"out_dir {out_dir} already holds an earlier run's checkpoints (latest: {ckpts[-1][1].name}) and "
            f"train.resume is false: train.resume=true continues that run; train.overwrite=true starts over "
            f"(removes its checkpoints/, best/ and metrics.jsonl); or choose another out_dir")


def write_summary(acc: Any, out_dir: Path, family: str, result: TrainResult, **fields: Any) -> dict[str, Any]:
    """An entry's summary.json (rank 0 writes it, every rank returns it): ``family``, the family's own ``fields``
    (feature source, draft vocabulary, ...), what ran and how fast, the scale-out fields every family carries
    (``TrainResult.summary_fields``) and the loss curve. ``peak_rss_loop_mb`` is rank 0's peak RSS during fit()
    (the loop's measure; scripts/bench_features.py reads it). Being every entry's last call, it also ends a
    multi-process run: all ranks meet, then the process group is destroyed."""
    if result.finished_earlier:  # the summary of the process that trained it stays (it has the losses and times)
        summary = json.loads((Path(out_dir) / "summary.json").read_text())
        _end_processes(acc)
        return summary
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
    _end_processes(acc)
    return summary


def _end_processes(acc: Any) -> None:
    """Tear the process group down before the interpreter exits: left to atexit, a gloo rank can abort with
    "terminate called without an active exception" after a finished run, failing the whole launch."""
    if acc.num_processes > 1:
        acc.wait_for_everyone()
        acc.end_training()


def save_run_config(cfg: Any, out_dir: Path) -> None:
    from omegaconf import OmegaConf

    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
