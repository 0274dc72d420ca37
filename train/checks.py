"""Training settings that would otherwise run and report a wrong result without a word.

``train.grad_accum=0`` trained nothing and still wrote ``final/``; ``train.device=cuda`` on a host without
CUDA trained on the CPU. Checked before the accelerator exists, so a bad value costs no model load.
"""

from __future__ import annotations

from typing import Any

import torch

from draftheads.heads.job import config_int


def check_train_config(cfg: Any) -> None:
    """Raise ValueError naming the ``train.*`` key, its value and what is allowed."""
    t = cfg.train
    for key in ("batch_size", "grad_accum", "log_every"):
        if t.get(key) is None:
            raise ValueError(f"train.{key} must be an integer >= 1, got null")
        config_int(t, key, None, 1, "train")
    # max_steps=0 is a use: write the initialized draft as final/ without training (e.g. an EAGLE-3 start point)
    for key in ("max_steps", "save_every", "keep_last", "eval_every"):
        config_int(t, key, 0, 0, "train")
    device = str(t.get("device", "auto"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={device} was asked for but torch sees no CUDA GPU (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda}); use train.device=auto or train.device=cpu")
