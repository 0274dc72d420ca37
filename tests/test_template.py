"""Assistant-only loss masks from the rendered chat template (ChatML / Llama-3 / Qwen2 goldens)."""

from __future__ import annotations

import pytest

from conftest import CHATML, LLAMA3, QWEN2, make_tokenizer
from draftheads.data_prep.template import TemplateError, assistant_spans, ensure_chat_template, prompt_ids, tokenize_conversation

CONV = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hello how are you"},
    {"role": "user", "content": "count to three"},
    {"role": "assistant", "content": "one two three"},
]

# What the assistant writes, per template: its content plus the end-of-turn token (not the glue after it).
GOLDEN = {
    "chatml": ["hello how are you<|im_end|>", "one two three<|im_end|>"],
    "llama3": ["hello how are you<|eot_id|>", "one two three<|eot_id|>"],
    "qwen2": ["hello how are you<|im_end|>", "one two three<|im_end|>"],
}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen2": QWEN2}


def _runs(ids, mask, tok):
    """Decode each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.mark.parametrize("name", ["chatml", "llama3", "qwen2"])
def test_golden_masks(name):
    tok = make_tokenizer(TEMPLATES[name])
    t = tokenize_conversation(tok, CONV)
    assert len(t.input_ids) == len(t.loss_mask)
    assert _runs(t.input_ids, t.loss_mask, tok) == GOLDEN[name]
    # everything else (system prompt, user turns, role headers, glue) is unmasked
    rest = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if not m])
    assert "hello there" in rest and "count to three" in rest
    assert "one two three" not in rest and "hello how are you" not in rest
    # the ids are exactly the tokenization of the rendered text (no double BOS, nothing dropped)
    text = tok.apply_chat_template(CONV, tokenize=False)
    assert tok.decode(t.input_ids) == text
    if name == "llama3":
        assert t.input_ids.count(tok.bos_token_id) == 1


def test_golden_token_level_chatml():
    """Pin the mask token by token for one case: it starts right after '<|im_start|>assistant\\n'."""
    tok = make_tokenizer(CHATML)
    conv = CONV[:2]
    t = tokenize_conversation(tok, conv)
    prompt = prompt_ids(tok, conv[:1])
    n_prompt = len(prompt)
    assert t.input_ids[:n_prompt] == prompt  # the generation prompt tokenizes identically inside the full text
    assert t.loss_mask[:n_prompt] == [0] * n_prompt
    answer = tok("hello how are you", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert t.input_ids[n_prompt:n_prompt + len(answer)] == answer
    assert t.loss_mask[n_prompt:n_prompt + len(answer)] == [1] * len(answer)
    assert t.loss_mask[n_prompt + len(answer):] == [0] * (len(t.loss_mask) - n_prompt - len(answer))


def test_system_turn_and_truncation():
    tok = make_tokenizer(CHATML)
    conv = [{"role": "system", "content": "be brief"}] + CONV
    t = tokenize_conversation(tok, conv)
    assert "be brief" not in tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if m])
    full = len(t.input_ids)
    short = tokenize_conversation(tok, conv, max_length=full - 3)
    assert short.truncated and len(short.input_ids) == full - 3
    assert short.loss_mask == t.loss_mask[: full - 3]
    with pytest.raises(TemplateError) as e:
        tokenize_conversation(tok, conv, max_length=5)  # cut before any assistant token
    assert e.value.reason == "no_assistant_tokens_after_truncation"


def test_no_chat_template_is_a_clear_error():
    tok = make_tokenizer(CHATML)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ensure_chat_template(tok)
    ensure_chat_template(tok, CHATML)  # an override fixes it
    assert tokenize_conversation(tok, CONV).loss_mask.count(1) > 0


def test_history_rewriting_template_is_refused():
    # a template that drops earlier assistant turns (like reasoning-stripping ones): not prefix-stable
    bad = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
           "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = make_tokenizer(bad)
    with pytest.raises(TemplateError, match="prefix") as e:
        assistant_spans(tok, CONV)
    assert e.value.reason == "template_not_prefix_stable"


def test_conversation_without_assistant_turn():
    tok = make_tokenizer(CHATML)
    with pytest.raises(TemplateError) as e:
        tokenize_conversation(tok, CONV[:1])
    assert e.value.reason == "no_assistant_tokens"
