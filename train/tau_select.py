"""How good the draft is while it trains (a part of ``train.loop.Trainer``): the teacher-forced simulated τ on
held-out rows every evaluation, and the measured τ of ``train.tau_eval`` (the real speculative loop, run by an
evaluator built from config) that keeps ``best/``."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from draftheads.heads.checkpoint import atomic_dir
from draftheads.train.batching import lockstep_batches
from draftheads.train.run import tau_every
from draftheads.train.sim_tau import accepted_lengths

log = logging.getLogger(__name__)


class TauMixin:
    """Simulated and measured τ for ``Trainer``; ``best/`` and its bookkeeping across resumes."""

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
        self.tau_at_start()  # a bad train.tau_eval.at_start fails here, before any step

    def tau_at_start(self) -> bool:
        """``train.tau_eval.at_start``: measure the head before step 1 as well (null: when it starts from trained
        weights, ``head.init_from``, so a fine-tune that only makes the head worse keeps the starting head in best/)."""
        want = self.cfg.train.tau_eval.get("at_start")
        if want is not None and not isinstance(want, bool):
            raise ValueError(f"train.tau_eval.at_start must be true, false or null (null: when head.init_from is set), "
                             f"got {want!r}")
        if want is None:
            want = bool(self.cfg.get("head", {}).get("init_from"))
        return self.tau_every > 0 and want

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
