"""scripts/bench_memory.py: training memory does not grow with the vocabulary (train/losses.py's chunked losses).

Slow: one process per family and vocabulary (peak RSS is per process), on tiny Gemma-3 bodies with a 49k and a
262k vocabulary. At 512 tokens a plain [n, V] loss would hold ~0.8 GB (49k) against ~4.3 GB (262k) of Medusa
logits alone; chunked, the two peaks net of weights and optimizer state stay within the issue's 1.5x.
Fast: the quickstart cell trains with the overrides scripts/quickstart.sh uses."""

from __future__ import annotations

import pytest

from draftheads.scripts.bench_memory import FAMILIES, launch, ratios


@pytest.mark.slow
def test_net_peak_on_a_262k_vocabulary_is_within_1_5x_of_a_49k_one():
    cells = []
    for family in FAMILIES:
        for target in ("random:tiny-49k", "random:tiny-262k"):
            spec = {"family": family, "target": target, "length": 512, "steps": 2}
            r = launch({**spec, "device": "cpu"}, max_rss_gb=8.0, timeout=900)
            assert r["status"] == "ok", r
            assert r["optimizer_state_mb"] > 0  # AdamW state exists: the steps ran
            cells.append({**spec, **r})
    got = {r["family"]: r["net_ratio"] for r in ratios(cells)}
    assert set(got) == set(FAMILIES)
    assert all(r <= 1.5 for r in got.values()), got


def test_quickstart_cell_trains_as_the_quickstart_script_does():
    """The benchmark's quickstart cell (QUICKSTART) carries the overrides of scripts/quickstart.sh's Medusa training
    line, read from the script with its defaults filled in, so the two cannot drift apart."""
    import re
    import shlex

    from draftheads.scripts.bench_memory import QUICKSTART, REPO

    text = (REPO / "scripts" / "quickstart.sh").read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, re.M))  # VAR=${VAR:-default}
    arrays = {k: v for k, v in re.findall(r"^(\w+)=\((.*)\)$", text, re.M)}  # NAME=(...) on one line
    line = re.search(r"^python train/medusa\.py (.*?)(?<!\\)$", text, re.M | re.S).group(1).replace("\\\n", " ")
    for name, body in arrays.items():
        line = line.replace(f'"${{{name}[@]}}"', body)
    words = shlex.split(re.sub(r"\$(\w+)", lambda m: defaults[m.group(1)], line))
    per_run = ("run_name=", "out_dir=", "train.max_steps=")  # the cell names its own run and step count
    assert sorted(w for w in words if not w.startswith(per_run)) == sorted(QUICKSTART)
