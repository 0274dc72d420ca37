"""scripts/paired_tau.py: paired bootstrap of target forwards between two measure runs (toy results files)."""

import json
import os
from pathlib import Path

import pytest

from draftheads.eval.tau import paired_bootstrap
from draftheads.scripts.paired_tau import compare


def _write(path, method, steps, tokens=32):
    rows = [{"method": "plain", "setting": "greedy", "question_id": i, "turn": 0, "steps": tokens,
             "accepted_total": 0, "new_tokens": tokens} for i in range(len(steps))]
    rows += [{"method": method, "setting": "greedy", "question_id": i, "turn": 0, "steps": s,
              "accepted_total": tokens - s, "new_tokens": tokens} for i, s in enumerate(steps)]
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"rows": rows}))
    return path


def test_a_consistent_saving_is_ahead_and_noise_is_not(tmp_path):
    base = [20, 18, 22, 19, 21, 20, 17, 23, 20, 19]
    a = _write(tmp_path / "a", "eagle", base)
    b = _write(tmp_path / "b", "eagle3", [s - 2 for s in base])
    res = compare(f"{a}:eagle", f"{b}:eagle3", boot=2000)
    assert res["saved"] == 20 and res["forwards_a"] - res["forwards_b"] == 20
    assert res["ci95"] == [20, 20] and res["verdict"] == "b ahead"
    assert res["tau_a"] == pytest.approx(320 / sum(base)) and res["tau_b"] == pytest.approx(320 / (sum(base) - 20))
    # +3 on half the prompts, -3 on the other half: a zero-mean difference stays within noise
    c = _write(tmp_path / "c", "eagle3", [s + (3 if i % 2 else -3) for i, s in enumerate(base)])
    res = compare(f"{a}:eagle", f"{c}:eagle3", boot=2000)
    assert res["saved"] == 0 and res["ci95"][0] < 0 < res["ci95"][1] and res["verdict"] == "within noise"
    assert res["prompts_b_better"] == 5 and res["prompts_b_worse"] == 5
    # reversed roles: a is ahead
    assert compare(f"{b}:eagle3", f"{a}:eagle", boot=2000)["verdict"] == "a ahead"


def test_bootstrap_interval_contains_the_observed_sum():
    a = [10, 12, 9, 15, 11, 13, 10, 14]
    b = [9, 13, 9, 12, 11, 10, 11, 12]
    res = paired_bootstrap(a, b, boot=4000, seed=1)
    assert res["saved"] == sum(a) - sum(b) == 7
    assert res["ci95"][0] <= 7 <= res["ci95"][1]


def test_bad_inputs_name_the_problem(tmp_path):
    a = _write(tmp_path / "a", "eagle", [20, 20])
    b = _write(tmp_path / "b", "eagle3", [18, 18], tokens=30)
    with pytest.raises(ValueError, match="emitted 32 tokens"):
        compare(f"{a}:eagle", f"{b}:eagle3")
    with pytest.raises(ValueError, match=r"no rows for method 'medusa'; it has \['eagle', 'plain'\]"):
        compare(f"{a}:medusa", f"{b}:eagle3")
    with pytest.raises(ValueError, match="RUN:METHOD"):
        compare(str(a), f"{b}:eagle3")
    with pytest.raises(ValueError, match="no results.json"):
        compare(f"{tmp_path / 'missing'}:eagle", f"{b}:eagle3")


def test_tau_definition_shared_by_measure_and_paired_tau():
    from draftheads.eval.tau import tau, tau_value

    rows = [{"steps": 10, "accepted_total": 5}, {"steps": 6, "accepted_total": 3}]
    assert tau(rows) == pytest.approx(24 / 16) == tau_value(8, 16)
    assert tau([]) == 0.0 == tau_value(0, 0)  # nothing measured (as aggregate always reported)


def test_turns_on_different_prompts_are_refused_or_skipped():
    from draftheads.eval.tau import paired_forwards

    ra = {(0, 0): {"steps": 10, "accepted_total": 6, "new_tokens": 16, "prompt_hash": "x"},
          (0, 1): {"steps": 12, "accepted_total": 4, "new_tokens": 16, "prompt_hash": "y"}}
    rb = {(0, 0): {"steps": 8, "accepted_total": 8, "new_tokens": 16, "prompt_hash": "x"},
          (0, 1): {"steps": 9, "accepted_total": 7, "new_tokens": 16, "prompt_hash": "z"}}  # turn 1 diverged
    with pytest.raises(ValueError, match=r"row \(0, 1\): their prompts differ"):
        paired_forwards(ra, rb, "a", "b")
    res = paired_forwards(ra, rb, "a", "b", boot=100, strict=False)
    assert res["rows"] == 1 and res["unequal_turns_skipped"] == 1 and res["saved"] == 2


def _write_turns(path, method, steps_by_turn, tokens=32):
    """steps_by_turn[t][q]: target forwards of question q's turn t (plain rows included, like measure.py)."""
    rows = []
    for t, steps in enumerate(steps_by_turn):
        for q, s in enumerate(steps):
            for m, st in (("plain", tokens), (method, s)):
                rows.append({"method": m, "setting": "greedy", "question_id": q, "turn": t, "steps": st,
                             "accepted_total": tokens - st, "new_tokens": tokens})
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({"rows": rows}))
    return path


def test_cluster_question_moves_a_questions_turns_together(tmp_path):
    base = [20, 18, 22, 19, 21, 20, 17, 23, 20, 19, 18, 21]
    a = _write_turns(tmp_path / "a", "eagle", [base, base])
    # b saves 3 on every first turn and loses 3 on every second: each question nets zero
    b = _write_turns(tmp_path / "b", "eagle3", [[s - 3 for s in base], [s + 3 for s in base]])
    by_q = compare(f"{a}:eagle", f"{b}:eagle3", boot=2000)
    assert by_q["cluster"] == "question" and by_q["resampled_units"] == 12 and by_q["prompts"] == 24
    assert by_q["saved"] == 0 and by_q["ci95"] == [0, 0] and by_q["verdict"] == "within noise"
    by_t = compare(f"{a}:eagle", f"{b}:eagle3", boot=2000, cluster="turn")
    assert by_t["resampled_units"] == 24 and by_t["ci95"][0] < -6 and by_t["ci95"][1] > 6  # turns drawn apart
    first = compare(f"{a}:eagle", f"{b}:eagle3", boot=2000, turn=0)
    second = compare(f"{a}:eagle", f"{b}:eagle3", boot=2000, turn=1)
    assert (first["saved"], first["verdict"], first["turn"]) == (36, "b ahead", 0)
    assert (second["saved"], second["verdict"], second["prompts"]) == (-36, "a ahead", 12)


def test_single_turn_runs_give_the_same_interval_either_way(tmp_path):
    base = [20, 18, 22, 19, 21, 20, 17, 23, 20, 19]
    a = _write(tmp_path / "a", "eagle", base)
    b = _write(tmp_path / "b", "eagle3", [s + (2 if i % 3 else -4) for i, s in enumerate(base)])
    q = compare(f"{a}:eagle", f"{b}:eagle3", boot=3000, seed=5)
    t = compare(f"{a}:eagle", f"{b}:eagle3", boot=3000, seed=5, cluster="turn")
    assert q["ci95"] == t["ci95"] and q["saved"] == t["saved"] and q["verdict"] == t["verdict"]


def test_cluster_and_turn_options_are_checked(tmp_path):
    a = _write(tmp_path / "a", "eagle", [20] * 10)
    b = _write(tmp_path / "b", "eagle3", [18] * 10)
    with pytest.raises(ValueError, match="cluster must be 'question' or 'turn', got 'prompt'"):
        compare(f"{a}:eagle", f"{b}:eagle3", cluster="prompt")
    with pytest.raises(ValueError, match=r"turn=1: .* has no rows for that turn"):
        compare(f"{a}:eagle", f"{b}:eagle3", turn=1)


def test_plot_runs_summarizes_heads_from_separate_runs(tmp_path, capsys):
    """scripts/plot_runs.py: τ overall and per category, P(accepted ≥ d) from per-step counts, one PNG."""
    from draftheads.scripts.plot_runs import main

    def write(path, method, accepted_by_q):
        rows = [{"method": method, "setting": "greedy", "question_id": q, "turn": 0, "category": "math" if q else "code",
                 "steps": len(acc), "accepted_total": sum(acc), "accepted": acc, "tree_depths": [3] * len(acc),
                 "new_tokens": len(acc) + sum(acc)} for q, acc in enumerate(accepted_by_q)]
        path.mkdir(parents=True)
        (path / "results.json").write_text(json.dumps({"rows": rows}))

    write(tmp_path / "a", "medusa", [[0, 1, 2, 0], [1, 1, 0, 0]])  # code: 7/4; math: 6/4; overall 13/8
    write(tmp_path / "b", "eagle3", [[3, 3], [2, 0, 1]])
    out = tmp_path / "fig" / "tau.png"
    assert main([f"out={out}", f"{tmp_path / 'a'}:medusa@Medusa", f"{tmp_path / 'b'}:eagle3"]) == 0
    heads = json.loads(capsys.readouterr().out)["heads"]
    med = heads["Medusa"]
    assert med["tau"] == pytest.approx(13 / 8, abs=1e-4)
    assert med["per_category"] == {"code": pytest.approx(1.75), "math": pytest.approx(1.5)}
    assert med["accept_at_depth"] == pytest.approx([4 / 8, 1 / 8, 0.0])
    assert med["ci95"][0] <= med["tau"] <= med["ci95"][1]
    assert heads["b:eagle3"]["accept_at_depth"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert out.stat().st_size > 10_000
    assert main([f"out={out}", f"{tmp_path / 'a'}:medusa", "setting=sampled"]) == 2
    assert "no rows for setting='sampled'" in capsys.readouterr().err
    assert main([f"out={out}", str(tmp_path / "a")]) == 2  # no :METHOD
    assert "expected RUN:METHOD" in capsys.readouterr().err


def test_save_png_never_leaves_a_half_written_image(tmp_path):
    """eval.report.save_png renders in memory and renames into place: a failed render keeps the old file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from draftheads.eval.report import save_png

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    out = tmp_path / "fig.png"
    save_png(fig, out)
    good = out.read_bytes()
    assert good[:8] == b"\x89PNG\r\n\x1a\n" and len(good) > 1000
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # what a plain open() would give, not mkstemp's 0600

    def broken(target, *a, **k):  # dies halfway through writing, wherever it writes
        if hasattr(target, "write"):
            target.write(b"\x89PNG half")
        else:
            Path(target).write_bytes(b"\x89PNG half")
        raise RuntimeError("renderer died")

    fig.savefig = broken
    with pytest.raises(RuntimeError, match="renderer died"):
        save_png(fig, out)
    assert out.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["fig.png"]
    plt.close(fig)


def test_acceptance_results_pair_with_each_other_and_with_a_measure_run(tmp_path):
    """eval/acceptance.py rows hold each step's accepted count: forwards = steps, accepted = their sum."""
    def acceptance(name, accepted_lists):
        rows = [{"question_id": i, "turn": 0, "new_tokens": sum(a) + len(a), "accepted": a}
                for i, a in enumerate(accepted_lists)]
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"mode": "greedy", "summary": {"tau": 0.0}, "rows": rows}))
        return f

    base = [[1, 0, 2, 1]] * 10  # 4 forwards, 8 tokens per prompt
    better = [[3, 3]] * 10  # 2 forwards, 8 tokens
    a, b = acceptance("a", base), acceptance("b", better)
    res = compare(str(a), str(b), boot=500)
    assert (res["forwards_a"], res["forwards_b"], res["saved"]) == (40, 20, 20) and res["verdict"] == "b ahead"
    assert res["tau_a"] == pytest.approx(2.0) and res["tau_b"] == pytest.approx(4.0)
    m = _write(tmp_path / "m", "eagle3", [4] * 10, tokens=8)  # a measure run's greedy rows pair with it
    assert compare(f"{m}:eagle3", str(b), boot=500)["saved"] == 20
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not an eval/acceptance.py result"):
        compare(str(tmp_path / "bad.json"), str(b))
