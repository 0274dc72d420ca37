"""What a run shows while it trains (a part of ``train.loop.Trainer``): the wandb run (offline by default) and
``training.png`` (loss, per-head accuracy, measured τ with best/'s step)."""

from __future__ import annotations

import os


class ReportMixin:
    """wandb and the training plot for ``Trainer``."""

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

        rows = [r for r in self.history if "loss" in r]  # training rows (a τ row before step 1 has no loss)
        steps = [r["step"] for r in rows]
        acc_keys = sorted(k for k in rows[-1] if k.startswith("top1/")) if rows else []
        taus = sorted({r["step"]: r["tau_eval/tau"] for r in self.history if "tau_eval/tau" in r}.items())
        fig, axes = plt.subplots(1, 3 if taus else 2, figsize=(15 if taus else 10, 3.5))
        if taus:  # train.tau_eval: measured τ per evaluation, best/'s step marked
            axes[2].plot([x for x, _ in taus], [y for _, y in taus], marker="o")
            if self.tau_best is not None:
                axes[2].axvline(self.tau_best["step"], color="gray", linestyle=":",
                                label=f"best/ (step {self.tau_best['step']})")
                axes[2].legend(fontsize=7)
            axes[2].set_xlabel("step"), axes[2].set_ylabel("τ (greedy)")
            axes[2].set_title("measured τ, held-out prompts")
        axes[0].plot(steps, [r["loss"] for r in rows])
        axes[0].set_xlabel("step"), axes[0].set_ylabel("loss"), axes[0].set_title("training loss")
        for k in acc_keys:
            axes[1].plot(steps, [r.get(k, float("nan")) for r in rows], label=k)
        axes[1].set_xlabel("step"), axes[1].set_ylabel("top-1 accuracy"), axes[1].set_title("per-head accuracy")
        if acc_keys:
            axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.out_dir / "training.png", dpi=110)
        plt.close(fig)
