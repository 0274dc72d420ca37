"""scripts/bench_allocator.py: the steady step time it reports, and its one-line argument errors."""

from __future__ import annotations

import json

import pytest

from draftheads.scripts.bench_allocator import SETTINGS, main, steady_seconds_per_step


def test_steady_seconds_per_step_leaves_out_the_warm_up(tmp_path):
    # cumulative steps_per_s from a fresh start: step s ends at elapsed t(s); warm-up step 1 takes 10 s, then 2 s each
    ends = {1: 10.0, 2: 12.0, 3: 14.0, 4: 16.0, 5: 18.0}
    rows = [{"step": s, "loss": 1.0, "steps_per_s": s / t} for s, t in ends.items()]
    rows.insert(2, {"step": 2, "tau_eval/tau": 1.5})  # rows without steps_per_s are ignored
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert steady_seconds_per_step(p, skip=2) == pytest.approx(2.0)
    assert steady_seconds_per_step(p, skip=0) == pytest.approx(2.0)  # from the first row (step 1): still steady
    assert steady_seconds_per_step(p, skip=5) is None  # one row left: no interval


def test_settings_name_what_they_change():
    assert SETTINGS["system"] == {"DRAFTHEADS_MALLOC": "system"} and SETTINGS["keep"] == {}


@pytest.mark.parametrize("argv, says", [(["--settings", "system,jemalloc"], "unknown ['jemalloc']"),
                                        (["--steps", "4", "--skip", "5"], "--steps 4 must be at least")])
def test_bad_arguments_are_one_line_errors(argv, says, tmp_path):
    with pytest.raises(SystemExit) as ei:
        main([*argv, "--out", str(tmp_path / "x.json")])
    assert str(ei.value).startswith("error: ") and says in str(ei.value)
    assert not (tmp_path / "x.json").exists()
