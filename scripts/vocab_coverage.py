"""Which EAGLE-3 draft vocabulary size does my data need? Held-out coverage per size, with and without a
reference corpus voting (prints JSON; no training, no target forward — the tokenizer and the data only).

    python scripts/vocab_coverage.py [sizes=[8192,16384,32000]] [reference=sharegpt] [out=FILE] [eagle3 overrides...]

The overrides are train/eagle3.py's (target=..., data=..., data.path=..., +experiment=eagle3_full), so the
training and held-out splits are exactly the ones that job would count. For each size: ``coverage`` (share of
training-split assistant tokens inside the vocabulary) and ``heldout_coverage`` (the honest one: every held-out
token outside is a guaranteed rejection), first ranked by the training split alone (train/eagle3.py without
``head.draft_vocab_reference``), then with ``reference`` voting (null: skipped).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from hydra import compose, initialize_config_dir  # noqa: E402

from draftheads.data_prep.dataset import prepare_data  # noqa: E402
from draftheads.data_prep.draft_vocab import (count_assistant_tokens, count_reference_tokens, ranking_scores,  # noqa: E402
                                   select_draft_vocab, vocab_stats)
from draftheads.heads import job  # noqa: E402
from draftheads.heads.checkpoint import atomic_write_text  # noqa: E402
from draftheads.heads.eagle3_vocab import resolve_draft_vocab_size  # noqa: E402
from draftheads.heads.target import load_target  # noqa: E402

OWN = ("sizes", "reference", "out")


def coverage_table(cfg: Any, sizes: list[int], reference: str | None) -> dict[str, Any]:
    """{"rows": [{draft_vocab_size, ranked_by, coverage, heldout_coverage}...], ...} for one composed config."""
    target = load_target(cfg.target)
    V = target.vocab_size
    data = prepare_data(cfg.data, target.tokenizer)
    if data.heldout is None or not len(data.heldout):
        raise ValueError("the data has no held-out split (data.heldout_fraction=0): held-out coverage needs one")
    train = count_assistant_tokens(data.train, V)
    held = count_assistant_tokens(data.heldout, V)
    rankings = {"training split": train}
    ref = None
    if reference:
        ref = count_reference_tokens(reference, target.tokenizer, V)
        rankings[f"training split + {reference}"] = ranking_scores(train, ref)
    rows = []
    for size in sizes:
        dv = resolve_draft_vocab_size(size, V)
        for name, scores in rankings.items():
            st = vocab_stats(train, select_draft_vocab(scores, dv), held, ref)
            rows.append({"draft_vocab_size": dv, "ranked_by": name, "coverage": st["coverage"],
                         "heldout_coverage": st.get("heldout_coverage"),
                         "reference_coverage": st.get("reference_coverage")})
    return {"target_vocab": V, "train_assistant_tokens": int(train.sum()),
            "distinct_train_ids": int((train > 0).sum()), "heldout_assistant_tokens": int(held.sum()),
            "reference": reference, "reference_tokens": None if ref is None else int(ref.sum()), "rows": rows}


def main(argv: list[str]) -> dict[str, Any]:
    own = {k: None for k in OWN}
    overrides = []
    for a in argv:
        k, _, v = a.partition("=")
        if k in OWN:
            own[k] = v
        else:
            overrides.append(a)
    sizes = json.loads(own["sizes"]) if own["sizes"] else [8192, 16384, 32000]
    if not isinstance(sizes, list) or not sizes or not all(isinstance(s, int) for s in sizes):
        raise ValueError(f"sizes must be a list of integers like [8192,32000], got {own['sizes']!r}")
    reference = "sharegpt" if own["reference"] is None else (own["reference"] if own["reference"] != "null" else None)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("eagle3", overrides=overrides)
    result = coverage_table(cfg, sizes, reference)
    text = json.dumps(result, indent=1)
    if own["out"]:
        Path(own["out"]).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(own["out"]), text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    job.cli(main, sys.argv[1:])  # bad sizes, data or reference file: one line naming it, no stack trace
