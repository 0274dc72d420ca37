"""Which kind of request a prompt is: a keyword/regex classifier of the first user message, for coverage reports.

Why so simple: the distill job only needs to *report* what its prompts cover (code, math, writing, extraction,
translation, summarization, QA) so a thin category is visible before training; it never filters on the label.
It is a heuristic, not a model: each prompt gets the first kind in :data:`KINDS` order whose pattern matches
(translation before code, so "translate this Python comment" counts as translation), ``other`` when none does.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

# Checked in this order; the first match wins. Case-insensitive.
PATTERNS: dict[str, str] = {
    "translation": r"\btranslat\w*|\binto (english|french|spanish|german|chinese|japanese|korean|russian|italian|"
                   r"portuguese|arabic|hindi|dutch|vietnamese|turkish)\b",
    "summarization": r"\bsummar(y|ies|i[sz]e\w*)\b|\btl;?dr\b|\bsum (it )?up\b|\bkey (points|takeaways)\b",
    "extraction": r"\bextract\w*|\bpull out\b|\bidentify (all|the|every)\b|\bfind all\b|\bnamed entit\w*|"
                  r"\b(list|return) (all|every|each) .{0,40}\b(mentioned|in the (text|passage|article))",
    "code": r"```|\bcode\b|\bfunction\b|\bpython\b|\bjavascript\b|\btypescript\b|\bjava\b|c\+\+|\bc#|\bsql\b|"
            r"\bhtml\b|\bcss\b|\bregex\b|\bbash\b|\bapi\b|\bcompil\w+|\bdebug\w*|\bscript\b|\breact\b|\bnode\.?js\b|"
            r"\bgolang\b|\brust\b|\bdef \w+\(|\bimport \w+|\bclass \w+|\bprogram\w*\b|\balgorithm\w*",
    "math": r"\bcalculat\w*|\bsolve\b|\bequations?\b|\bmath\w*|\bintegral\b|\bderivative\b|\bprobabilit\w*|"
            r"\bprove\b|\btheorem\b|\bpercent\w*|\d+\s*[-+*/^x×]\s*\d+\s*=?",
    "writing": r"\bwrite\b|\bwriting\b|\bessay\b|\bpoem\b|\bstory\b|\bdraft\b|\bblog\b|\barticle\b|\bletter\b|"
               r"\bemail\b|\brewrite\b|\bcompose\b|\bslogan\b|\bparagraph\b|\bcaption\b|\blyrics\b|\bspeech\b",
    "qa": r"\?\s*$|^\s*(what|why|how|who|when|where|which|is|are|can|could|does|do|did|should|explain|define|"
          r"describe|tell me)\b",
}
KINDS: tuple[str, ...] = tuple(PATTERNS) + ("other",)
_COMPILED = [(k, re.compile(p, re.IGNORECASE | re.MULTILINE)) for k, p in PATTERNS.items()]


def prompt_kind(text: str) -> str:
    """The first kind whose pattern matches ``text`` (``other`` if none)."""
    for kind, rx in _COMPILED:
        if rx.search(text):
            return kind
    return "other"


def kind_counts(texts: Iterable[str]) -> dict[str, int]:
    """Prompts per kind, every kind listed (zeros included) in :data:`KINDS` order."""
    c = Counter(prompt_kind(t) for t in texts)
    return {k: c.get(k, 0) for k in KINDS}
