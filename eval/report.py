"""Render a measurement (eval/measure.py ``results.json``) as markdown tables and PNG plots.

    python eval/report.py runs/measure/<run>/results.json   # re-render after the fact

Why separate from the job: the big runs take hours, the report is cheap to iterate on.
Files: ``report.md``, ``tau_by_category.png`` (τ and speedup over plain per category, per method),
``accept_by_depth.png`` (P(accepted ≥ d) and conditional acceptance per depth), ``speedup_vs_tree_size.png``
(the device's verification latency profile and the modeled / measured speedup per tree size).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

from draftheads.heads.checkpoint import atomic_write_bytes, atomic_write_text

LOOKUP = ("prompt_lookup", "hf_prompt_lookup")


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return out


def _main_setting(result: dict[str, Any]) -> str:
    return "greedy" if "greedy" in result["settings"] else next(iter(result["settings"]))


def markdown(result: dict[str, Any]) -> str:
    t = result["target"]
    L = [f"# Speculative decoding measurement: {t['name']} ({result['dtype']}, {result['device']}, "
         f"{result['threads']} threads)", "",
         f"Questions: `{result['questions']}` ({result['num_questions']} questions, up to {result['max_turns']} "
         f"turns, {result['max_new_tokens']} new tokens per turn). Every method decodes with the same target, dtype "
         f"and KV cache, questions interleaved across methods. τ = accepted + 1 per verification forward; "
         f"× = tokens/s ratio (wall clock, prefill included); bookkeeping = everything outside the target and "
         f"draft forwards (masks, verification, cache compaction), per step and as % of a one-token target "
         f"forward t_1 = {_f(result['latency_profile']['t1_ms'])} ms. Job time {result.get('job_seconds', '?')} s; "
         f"load average (1/5/15 min) {(result.get('load_average') or {}).get('start')} at the start, "
         f"{(result.get('load_average') or {}).get('end')} at the end (other jobs skew wall-clock numbers).", ""]
    h = result.get("headline") or {}
    if h:
        kind = "trained head" if h.get("trained") else "drafter (no trained head in this run)"
        L += ["## Headline", "",
              f"Fastest {kind} (greedy tokens/s): **{h['best']}** — τ {_f(h['tau'])}, {_f(h['tokens_per_s'])} tokens/s, "
              f"**{_f(h['speedup_vs_plain'])}×** plain decoding"
              + (f", **{_f(h['speedup_vs_hf_prompt_lookup'])}×** transformers' prompt lookup"
                 if h.get("speedup_vs_hf_prompt_lookup") is not None else "")
              + (f"; greedy identical to plain on {h['greedy_identical']} turns" if h.get("greedy_identical") else "")
              + f"; bookkeeping {_f(h['bookkeeping_ms_per_step'])} ms/step "
                f"({_f(h.get('bookkeeping_pct_of_t1'), 1)}% of t_1).", ""]
    for sname, block in result["settings"].items():
        L += [f"## {sname} ({block['mode']}" + (f", {block['sampling']}" if block["sampling"] else "") + ")", ""]
        skipped = {n: k for n, k in (block.get("turns_skipped_long_prompt") or {}).items() if k}
        if skipped:
            L += ["Turns skipped because their prompt was longer than max_prompt_tokens="
                  f"{result['config'].get('max_prompt_tokens')} (a question's later turns go with it): "
                  + ", ".join(f"{n} {k}" for n, k in skipped.items()) + ".", ""]
        sp, sh = block["speedup_vs_plain"], block.get("speedup_vs_hf_prompt_lookup") or {}
        gi = block.get("greedy_identical") or {}
        rows = []
        for name, s in block["methods"].items():
            ident = "ref" if name == "plain" and gi else (
                f"{gi[name]['identical']}/{gi[name]['comparable_turns']}" if name in gi else "–")
            rows.append([name, s["tau"], s["tokens_per_s"], sp[name]["overall"],
                         sh[name]["overall"] if name in sh else None, s.get("modeled_speedup"),
                         s.get("mean_tree_size"), s["target_ms_per_step"], s["draft_ms_per_step"],
                         s["bookkeeping_ms_per_step"], s.get("bookkeeping_pct_of_t1"), ident])
        L += _table(["method", "τ", "tokens/s", "× plain", "× HF lookup", "modeled ×", "tree size", "target ms/step",
                     "draft ms/step", "bookkeeping ms/step", "bookkeeping % t_1", "greedy identical"], rows)
        L += [""]
        oov = {n: s["draft_vocab_oov"] for n, s in block["methods"].items() if s.get("draft_vocab_oov") is not None}
        if oov:
            L += ["Emitted tokens outside the draft vocabulary (never proposable, so each one is a rejection): "
                  + "; ".join(f"{n} {100 * x:.1f}%" for n, x in oov.items()) + ".", ""]
        # per category: τ and speedup; prompt lookup marked where it wins / loses against plain
        cats = sorted({c for s in block["methods"].values() for c in s["per_category"]})
        names = list(block["methods"])
        rows = []
        for c in cats:
            row: list[Any] = [c]
            for n in names:
                pc = block["methods"][n]["per_category"].get(c)
                x = sp[n]["per_category"].get(c)
                if pc is None:
                    row.append("–")
                    continue
                mark = ""
                if n in LOOKUP and x is not None:
                    mark = " ✔" if x > 1.0 else " ✘"
                row.append(f"{pc['tau']:.2f} / {x:.2f}×{mark}" if x is not None else f"{pc['tau']:.2f}")
            rows.append(row)
        L += ["τ / speedup over plain by category (✔ prompt lookup wins over plain, ✘ loses):", ""]
        L += _table(["category"] + names, rows) + [""]
        if gi:
            div = {n: g for n, g in gi.items() if g["first_divergence"]}
            if div:
                L += ["First divergence from plain greedy (token index; expected in bf16, a bug in fp32): " +
                      "; ".join(f"{n}: median {g['median_first_divergence']} over {len(g['first_divergence'])} turns"
                                for n, g in div.items()), ""]
        h2h = block.get("head_to_head") or []
        if h2h:
            L += ["Head to head (target forwards on the same turns; B's saving over A with a 95% paired-bootstrap "
                  "interval over questions, a question's turns resampled together):", ""]
            L += _table(["A", "B", "turns", "forwards A", "forwards B", "τ A", "τ B", "saved by B, 95% CI", "verdict"],
                        [[p["a"], p["b"], p["rows"], p["forwards_a"], p["forwards_b"], _f(p["tau_a"], 3),
                          _f(p["tau_b"], 3), f"{p['saved']:+d} [{p['ci95'][0]:+d}, {p['ci95'][1]:+d}]", p["verdict"]]
                         for p in h2h]) + [""]
        rows = []
        for n, s in block["methods"].items():
            d = s["depth"]
            if not d["accept_at_depth"]:
                continue
            rows.append([n, d["alpha"], d["formula_tau"], d["measured_tau"],
                         " ".join(f"{a:.2f}" for a in d["accept_at_depth"]),
                         " ".join("–" if a is None else f"{a:.2f}" for a in d["conditional_accept"])])
        if rows:
            L += ["Acceptance by depth: P(accepted ≥ d) and P(accepted ≥ d | reached d − 1); the seed's formula "
                  "(1 − α^(k+1))/(1 − α) with α pooled over depths and each step's own depth k, as a cross-check:", ""]
            L += _table(["method", "α", "formula τ", "measured τ", "P(acc ≥ d), d = 1…", "conditional"], rows) + [""]
    L += tree_choice_section(result.get("tree_choice") or {})
    prof = result["latency_profile"]
    L += [f"## Verification latency profile ({prof['context']} cached tokens, median of {prof['repeats']})", ""]
    L += _table(["tokens in one forward", "ms", "× t_1"], [[p["width"], p["ms"], p["ratio_to_t1"]]
                                                          for p in prof["points"]]) + [""]
    sw = result.get("sweep") or {}
    series = {k: v for k, v in sw.items() if isinstance(v, list)}
    if series:
        L += [f"## Speedup by tree size (greedy, {sw['questions']} questions, first turns, {sw['max_new_tokens']} "
              f"tokens)", "",
              "modeled × = τ / ((t_verify(tree size) + t_draft) / t_1) from the profile above; measured × = wall-clock "
              "tokens/s over plain decoding on the same questions.", ""]
        rows = [[n, p["size"], p["tau"], p["mean_tree_size"], p["t_verify_ms"], p["draft_ms_per_step"],
                 p["modeled_speedup"], p["measured_speedup"]] for n, ps in series.items() for p in ps]
        L += _table(["method", "size", "τ", "mean nodes", "t_verify ms", "draft ms", "modeled ×", "measured ×"], rows)
        best = {n: max(ps, key=lambda p: p["modeled_speedup"] or 0) for n, ps in series.items() if ps}
        L += ["", "Best modeled size on this device: " + "; ".join(
            f"{n} {p['size']} ({_f(p['modeled_speedup'])}×)" for n, p in best.items()), ""]
    return "\n".join(L) + "\n"


def tree_choice_section(choices: dict[str, Any]) -> list[str]:
    """tree=auto per method: the chosen tree, the modeled and the measured speedup, and their ratio."""
    if not choices:
        return []
    from draftheads.eval.autotree import tree_label

    any_c = next(iter(choices.values()))
    cal = any_c["calibration"]
    L = ["## Tree choice (tree.select=auto)", "",
         "Each tree knob left null was chosen for the most modeled tokens/s = E[accepted + 1 | tree] / (t_verify(width) "
         "+ t_draft + bookkeeping), with acceptance by depth and rank measured on "
         f"{cal['prompts']} held-out calibration prompts (`{cal['source']}`, never the measured questions) and this "
         "device's latency profile; modeled × is that prediction over plain, made before decoding; measured × is the "
         "greedy run above. Explicit `tree.*` / `baselines.*` values are kept as given.", ""]
    rows = []
    for n, c in choices.items():
        ch, d = c["chosen"], c.get("default") or {}
        tau_ratio = round(c["measured_tau"] / ch["expected_tokens"], 3) if c.get("measured_tau") else None
        rows.append([n, tree_label(ch), ch["expected_tokens"], c.get("measured_tau"), tau_ratio, ch["t_verify_ms"],
                     ch["t_draft_ms"], ch["bookkeeping_ms"], ch["modeled_speedup"], c.get("measured_speedup"),
                     c.get("measured_over_modeled"), d.get("modeled_speedup"), c.get("seconds")])
    L += _table(["method", "chosen tree", "E[acc+1] modeled", "τ measured", "τ / E", "t_verify ms", "t_draft ms",
                 "bookkeeping ms", "modeled ×", "measured ×", "measured / modeled", "default tree modeled ×",
                 "choice s"], rows) + [""]
    return L


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Render a matplotlib figure to PNG bytes in memory, then write them atomically (no half-written image)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(path, buf.getvalue())


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """The three PNGs; matplotlib with the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    files = []
    sname = _main_setting(result)
    block = result["settings"][sname]
    names = list(block["methods"])
    cats = sorted({c for s in block["methods"].values() for c in s["per_category"]})

    # 1. τ and speedup by category per method
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 1.2 * len(cats) * max(1, len(names)) / 2 + 3), 7), sharex=True)
    x = np.arange(len(cats) + 1)
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        s = block["methods"][n]
        tau = [s["per_category"].get(c, {}).get("tau", np.nan) for c in cats] + [s["tau"]]
        spd = [block["speedup_vs_plain"][n]["per_category"].get(c, np.nan) for c in cats] + \
              [block["speedup_vs_plain"][n]["overall"]]
        axes[0].bar(x + i * w - 0.4 + w / 2, tau, w, label=n)
        axes[1].bar(x + i * w - 0.4 + w / 2, spd, w, label=n)
    axes[0].set_ylabel("τ (tokens per target forward)")
    axes[1].set_ylabel("tokens/s ÷ plain")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_xticks(x, cats + ["overall"], rotation=30, ha="right")
    axes[0].legend(fontsize=8, ncol=min(4, len(names)))
    axes[0].set_title(f"τ and speedup by category ({sname})")
    fig.tight_layout()
    files.append(out_dir / "tau_by_category.png")
    save_png(fig, files[-1])
    plt.close(fig)

    # 2. acceptance by depth
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        d = block["methods"][n]["depth"]
        if not d["accept_at_depth"]:
            continue
        ds = np.arange(1, len(d["accept_at_depth"]) + 1)
        axes[0].plot(ds, d["accept_at_depth"], marker="o", label=n)
        axes[1].plot(ds, [np.nan if a is None else a for a in d["conditional_accept"]], marker="o", label=n)
    axes[0].set_title("P(accepted ≥ d)")
    axes[1].set_title("P(accepted ≥ d | reached d − 1)")
    for ax in axes:
        ax.set_xlabel("tree depth d")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Acceptance by depth ({sname})")
    fig.tight_layout()
    files.append(out_dir / "accept_by_depth.png")
    save_png(fig, files[-1])
    plt.close(fig)

    # 3. latency profile and speedup vs tree size
    prof = result["latency_profile"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ws = [p["width"] for p in prof["points"]]
    axes[0].plot(ws, [p["ms"] for p in prof["points"]], marker="o")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("tokens verified in one forward")
    axes[0].set_ylabel("ms")
    axes[0].set_title(f"Verification latency ({prof['context']}-token cache)")
    axes[0].grid(alpha=0.3)
    sw = result.get("sweep") or {}
    for n, ps in sw.items():
        if not isinstance(ps, list) or not ps:
            continue
        line, = axes[1].plot([p["size"] for p in ps], [p["modeled_speedup"] for p in ps], marker="o",
                             label=f"{n} modeled")
        axes[1].plot([p["size"] for p in ps], [p["measured_speedup"] for p in ps], marker="x", ls="--",
                     color=line.get_color(), label=f"{n} measured")
    for n, s in block["methods"].items():  # the main run's methods at their configured size
        size = (result.get("methods", {}).get(n) or {}).get("tree_size") or s.get("mean_tree_size")
        if n != "plain" and size and size > 1:
            axes[1].scatter([size], [block["speedup_vs_plain"][n]["overall"]], marker="*", s=80,
                            zorder=3, label=f"{n} (main run, {sname}, measured)")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("tree size (nodes verified per step, root included)")
    axes[1].set_ylabel("speedup over plain")
    axes[1].set_title("Speedup vs tree size")
    axes[1].grid(alpha=0.3)
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "speedup_vs_tree_size.png")
    save_png(fig, files[-1])
    plt.close(fig)
    return files


def write_report(result: dict[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write report.md and the PNGs next to results.json; return their paths and the markdown text."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(result)
    atomic_write_text(out_dir / "report.md", md)
    files = [out_dir / "report.md"] + plots(result, out_dir)
    return {"files": [str(f) for f in files], "markdown_text": md}


def _cli(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python eval/report.py runs/measure/<run>/results.json")
    path = Path(argv[0])
    r = write_report(json.loads(path.read_text()), path.parent)
    print("\n".join(r["files"]))


if __name__ == "__main__":
    from draftheads.heads import job

    job.cli(_cli, sys.argv[1:])
