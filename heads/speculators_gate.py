"""What both exporters' speculators round trips share: the Python check, the chat-templated prompt they run and the
pass/fail gate on its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KEY_PROBLEMS = ("missing_in_file", "unexpected_in_file", "value_mismatch")


def check_python(python: Path) -> None:
    if not python.is_file():
        raise ValueError(f"speculators_python={python} is not a file: point it at a Python that has the speculators "
                         f"package (bash scripts/make_speculators_venv.sh creates .venv-spec/bin/python)")


def chat_prompt_ids(target: Any, prompt: str) -> torch.Tensor:
    """[1, T] ids of ``prompt`` as one user turn in the target's chat template, generation prompt added."""
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError(f"the speculators round trip needs the target's tokenizer with a chat template; target "
                         f"{target.identity.name!r} has none")
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(target.device)


def gate(result: dict[str, Any], export_dir: Path, what: str, rel_tol: float) -> dict[str, Any]:
    """Raise ValueError on key problems or on logits further than ``rel_tol`` × scale from ours; else the result."""
    bad = [k for k in KEY_PROBLEMS if result[k]]
    if bad:
        raise ValueError(f"speculators loaded the export {export_dir} with key problems: "
                         + "; ".join(f"{k}: {result[k][:5]}" for k in bad))
    diff, scale = result["fp32_max_abs_diff"], result["logit_scale"]
    if not diff <= rel_tol * scale:
        raise ValueError(f"speculators' {what} for the export {export_dir} differ from ours by {diff:.3g} at logit "
                         f"scale {scale:.3g} (allowed {rel_tol:g} × scale): the export does not reproduce the draft")
    return result
