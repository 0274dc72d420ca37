"""Tokenize a conversation with the target's own chat template and mark the assistant tokens.

Why this way: the loss must cover exactly the tokens the target would generate as the assistant,
for whatever template the target ships (ChatML, Llama-3, Qwen2, ...). Instead of hard-coding
separators, the assistant spans are found by rendering the template twice per assistant turn:
once up to the turn with the generation prompt (``prefix``), once including the turn (``upto``).
``upto[len(prefix):]`` is what the model writes — its content plus its end-of-turn token — and
the character spans map to tokens through the fast tokenizer's offset mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


class TemplateError(ValueError):
    """A conversation or tokenizer the chat-template renderer cannot handle."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is written by the assistant (a training target)
    truncated: bool


def ensure_chat_template(tokenizer: Any, override: str | None = None) -> None:
    """Install an override template (Jinja text or a path to a .jinja file) or fail clearly if none exists."""
    if override:
        from pathlib import Path

        p = Path(override)
        tokenizer.chat_template = p.read_text() if p.suffix in (".jinja", ".j2", ".txt") and p.is_file() else override
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "?")
        raise TemplateError(
            "no_chat_template",
            f"the tokenizer of {name!r} has no chat template, so assistant tokens cannot be located; "
            f"set data.chat_template to a Jinja template string or a .jinja file")
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError("slow_tokenizer", "a fast (Rust) tokenizer is required for the offset mapping")


def _render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return (text, character spans written by the assistant)."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise TemplateError(
                "template_not_prefix_stable",
                f"the chat template does not render turn {i} as an extension of the earlier turns "
                f"(it rewrites history, e.g. strips reasoning); cannot locate assistant tokens — "
                f"set data.chat_template to a prefix-stable template")
        start, end = len(prefix), len(upto)
        # Glue after the end-of-turn token (usually a newline) is written by the template, not the model:
        # generation stops at the end-of-turn token.
        while end > start and upto[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], max_length: int | None = None) -> Tokenized:
    """Token ids of the rendered conversation and its assistant-only loss mask (aligned per token)."""
    text, spans = assistant_spans(tokenizer, messages)
    if not spans:
        raise TemplateError("no_assistant_tokens", "the conversation renders no assistant tokens")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    mask = [0] * len(ids)
    j = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and s >= spans[j][1]:
            j += 1
        if j < len(spans) and spans[j][0] <= s < spans[j][1] and e > s:
            mask[t] = 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise TemplateError("no_assistant_tokens_after_truncation",
                            f"no assistant token within the first {max_length} tokens")
    return Tokenized(ids, mask, truncated)


def prompt_ids(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """Token ids that prompt the assistant's next turn (for generation and eval)."""
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
