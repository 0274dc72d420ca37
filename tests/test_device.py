"""Device resolution shared by every job that loads the target (distill, features, measure, acceptance)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from draftheads.eval.verify import verify_tree
from draftheads.heads.target import resolve_device

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_auto_picks_the_gpu_when_one_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 1)


def test_explicit_devices_are_kept_and_bad_ones_named(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'cuda' was asked for but torch sees no CUDA GPU.*device=auto"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"unknown device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match=r"unsupported device 'meta'"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2': only 2 CUDA GPU\(s\) visible"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("job", ["measure", "eval", "distill", "features"])
def test_jobs_that_load_the_target_default_to_auto_and_it_resolves_here(job):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name=job)
    assert cfg.device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(cfg.device).type == expected


def test_exact_rule_reads_rows_of_any_dtype_and_works_on_the_cpu():
    """Rows are verified in float64 on the CPU whatever the target's dtype (bf16 rows from a GPU target, say):
    the same uniforms give the same decision for a float32 table and its bf16-rounded copy when the
    acceptance probabilities are far from the uniforms drawn."""
    tokens = torch.tensor([0, 2, 3])
    parents = torch.tensor([-1, 0, 0])
    p = torch.tensor([[0.0, 0.0, 0.75, 0.25], [0.25] * 4, [0.25] * 4])  # exactly representable in bf16
    for probs in (p, p.to(torch.bfloat16)):
        got = [verify_tree(tokens, parents, probs, None, mode="exact",
                           generator=torch.Generator().manual_seed(s)) for s in range(200)]
        accepted = sum(1 for a, _ in got if a == [1])
        assert 110 < accepted < 190  # node 1 (token 2) accepted with p = 0.75
        if probs.dtype == torch.float32:
            ref = got
    assert got == ref  # bf16 copy decides identically: the rule ran on the same float64 values
