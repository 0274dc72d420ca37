"""Prepare a dataset for a target: python data_prep/prepare.py [data=...] [target=...]

Loads conversations, normalizes roles, drops repeats, splits train/held-out by opener (or id), tokenizes with the
target's chat template and assistant-only loss masks, and caches the result as Arrow. Training and
eval call the same ``prepare_data`` and hit the cache, so running this first is optional — it is
where you see the counts (read / kept / skipped by reason, truncated, tokens) before training.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from omegaconf import DictConfig

from draftheads.data_prep.dataset import prepare_data
from draftheads.heads import job
from draftheads.heads.target import TargetConfig

log = logging.getLogger(__name__)


def main(cfg: DictConfig) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from draftheads.heads.target_source import resolve_target

    # Only the tokenizer is needed: resolve the target's directory without loading its weights.
    tcfg = TargetConfig(**{k: v for k, v in dict(cfg.target).items() if k in TargetConfig.__dataclass_fields__})
    path, _ = resolve_target(tcfg)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=tcfg.trust_remote_code,
                                        local_files_only=tcfg.local_files_only,
                                        revision=None if path != tcfg.name else tcfg.revision)
    data = prepare_data(cfg.data, tok, force=bool(cfg.force))
    s = data.stats
    print(json.dumps({k: s[k] for k in ("load", "split", "train", "heldout", "rows", "seconds", "records_per_s")},
                     indent=2))
    print(f"prepared: {data.path}\nheld-out questions: {data.heldout_questions}")
    return s


@job.main(config_name="prepare")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
