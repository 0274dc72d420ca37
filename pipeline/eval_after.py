"""Evaluation after training (``train.eval_after``): eval/acceptance.py on the final head, so one sweep job is
train + eval. The trainer reaches this through ``train.eval_after._target_`` (hydra instantiate), never by import.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from omegaconf import OmegaConf, open_dict

from draftheads.eval.acceptance import main as eval_main

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(name: str, overrides: Sequence[str] = ()) -> Any:
    """Compose a shipped config from inside a Hydra job (its search path is conf/) or from plain code."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name=name, overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


class EvalAfter:
    """``runner(run_cfg, final_dir, out_dir) -> summary``: eval/acceptance.py on ``final_dir``, writing out_dir/eval.json.

    The eval config is conf/eval.yaml with the run's own target and data (so the held-out split is the one the
    run never trained on) and ``overrides`` (the other ``train.eval_after`` fields: questions, max_questions, ...,
    any eval setting) on top."""

    def __init__(self, **overrides: Any):
        self.overrides = {k: (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v)
                          for k, v in overrides.items()}

    def __call__(self, run_cfg: Any, final_dir: Path, out_dir: Path) -> dict[str, Any]:
        evcfg = compose_config("eval")
        with open_dict(evcfg):
            evcfg.target = OmegaConf.to_container(run_cfg.target, resolve=True)
            evcfg.data = OmegaConf.to_container(run_cfg.data, resolve=True)
            evcfg.checkpoint = str(final_dir)
            evcfg.out = str(Path(out_dir) / "eval.json")
            for k, v in self.overrides.items():
                if k not in evcfg:
                    raise ValueError(f"train.eval_after.{k} is not an eval setting (see conf/eval.yaml)")
                if isinstance(v, dict):
                    evcfg[k] = OmegaConf.merge(evcfg[k], v)
                else:
                    evcfg[k] = v
        t0 = time.perf_counter()
        res = eval_main(evcfg)
        s = res["summary"]
        return {"tau": s["tau"], "tokens_per_s": s["tokens_per_s"], "accept_at_depth": s["accept_at_depth"],
                "turns": s["turns"], "seconds": round(time.perf_counter() - t0, 1), "file": str(evcfg.out)}
