"""Tests for data_prep.sources (conversation loading / normalization / splitting)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from draftheads.data_prep import json_stream
from draftheads.data_prep.sources import (
    Conversation,
    DataError,
    LoadStats,
    iter_records,
    load_conversations,
    normalize_record,
    sharegpt_path,
)
from draftheads.data_prep.splits import conversation_key, dedupe_conversations, prompt_key, split_conversations


# --------------------------------------------------------------------------- helpers

def sg(id_, *turns):
    """ShareGPT record from (from, value) pairs."""
    return {"id": id_, "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = [
    sg("a", ("human", "hi"), ("gpt", "hello")),
    sg("b", ("human", "2+2?"), ("gpt", "4"), ("human", "and 3+3?"), ("gpt", "6")),
    sg("c", ("system", "be brief"), ("human", "q"), ("gpt", "a")),
    sg("d", ("human", "héllo ☃ 😀"), ("gpt", "ünïcödé\nline")),
]


def write_array(path, records, indent=2):
    path.write_text(json.dumps(records, indent=indent, ensure_ascii=False), encoding="utf-8")
    return path


def write_jsonl(path, lines):
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return path


def assert_well_formed(conv: Conversation):
    msgs = conv.messages
    assert isinstance(conv.id, str) and conv.id
    assert msgs, conv
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    assert body and len(body) % 2 == 0, [m["role"] for m in msgs]
    for i, m in enumerate(body):
        assert m["role"] == ("user" if i % 2 == 0 else "assistant"), [m["role"] for m in msgs]
    for m in msgs:
        assert set(m) == {"role", "content"}
        assert isinstance(m["content"], str) and m["content"].strip()


def check_accounting(stats: LoadStats):
    if not stats.stopped_early:
        assert stats.kept + sum(stats.skipped.values()) + stats.superseded == stats.read, stats


def norm(record, index=0):
    fixed: dict[str, int] = {}
    conv = normalize_record(record, index, fixed=fixed)
    assert_well_formed(conv)
    return conv, fixed


# --------------------------------------------------------------------------- file formats

def test_json_array_roundtrip(tmp_path):
    p = write_array(tmp_path / "a.json", GOOD)
    convs, st = load_conversations("test", path=str(p))
    assert [c.id for c in convs] == ["a", "b", "c", "d"]
    assert st.read == st.kept == 4 and not st.skipped and not st.truncated_tail
    assert st.format == "json_array"
    assert convs[3].messages == [{"role": "user", "content": "héllo ☃ 😀"},
                                 {"role": "assistant", "content": "ünïcödé\nline"}]
    assert convs[2].messages[0] == {"role": "system", "content": "be brief"}
    assert "read 4, kept 4" in st.summary()


@pytest.mark.parametrize("chunk", [3, 64, 1 << 20])
def test_truncated_array_recovers_complete_records(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_stream, "CHUNK_CHARS", chunk)
    text = json.dumps(GOOD, indent=2, ensure_ascii=False)
    cut = text.index('"id": "c"') + 12          # inside record 2
    p = tmp_path / "cut.json"
    p.write_text(text[:cut], encoding="utf-8")
    convs, st = load_conversations("cut", path=str(p))
    assert [c.id for c in convs] == ["a", "b"]
    assert st.truncated_tail and st.read == 2
    # the reported location is the byte offset / line where record 2 starts
    start = text.index('{\n    "id": "c"')
    assert f"byte {len(text[:start].encode())}" in st.truncated_at
    assert f"line {text[:start].count(chr(10)) + 1}" in st.truncated_at
    assert "truncated" in st.summary()
    # plain iter_records reports it through stats too
    st2 = LoadStats("x")
    assert [i for i, _ in iter_records(p, stats=st2)] == [0, 1]
    assert st2.truncated_tail


def test_truncation_at_every_offset_of_a_record(tmp_path):
    recs = GOOD[:1] + [{"id": "x", "flag": True, "none": None, "n": -12.5e3,
                        "conversations": [{"from": "human", "value": "hello \u00e9 \\ \""},
                                          {"from": "gpt", "value": "ok"}]}]
    text = json.dumps(recs, indent=2, ensure_ascii=True)
    first = text.index('{\n    "id": "x"')
    last = text.rindex("}")  # end of record x
    p = tmp_path / "t.json"
    for pos in range(first, last):
        p.write_text(text[:pos], encoding="utf-8")
        convs, st = load_conversations("t", path=str(p), on_error="raise")
        assert [c.id for c in convs] == ["a"] and st.truncated_tail, (pos, text[pos - 10:pos])
    p.write_text(text[:last + 1])  # record complete, array not closed
    convs, st = load_conversations("t", path=str(p))
    assert [c.id for c in convs] == ["a", "x"] and st.truncated_tail


def test_array_missing_closing_bracket(tmp_path):
    text = json.dumps(GOOD, indent=2).rstrip()[:-1]  # drop the final ']'
    p = tmp_path / "nobracket.json"
    p.write_text(text)
    convs, st = load_conversations("x", path=str(p))
    assert len(convs) == 4 and st.truncated_tail


def test_truncated_before_first_record_raises(tmp_path):
    text = json.dumps(GOOD, indent=2)
    p = tmp_path / "early.json"
    p.write_text(text[:40])
    with pytest.raises(DataError) as ei:
        load_conversations("x", path=str(p))
    msg = str(ei.value)
    assert str(p) in msg and "byte 4" in msg and "record 0" in msg


def test_corrupt_record_in_pretty_array(tmp_path):
    text = json.dumps(GOOD, indent=2)
    bad = text.replace('"id": "b"', '"id": "b" oops', 1)
    p = tmp_path / "corrupt.json"
    p.write_text(bad)
    convs, st = load_conversations("x", path=str(p))
    assert [c.id for c in convs] == ["a", "c", "d"]
    assert st.skipped == {"bad_json": 1} and st.read == 4
    with pytest.raises(DataError) as ei:
        load_conversations("x", path=str(p), on_error="raise")
    assert "record 1" in str(ei.value) and str(p) in str(ei.value) and ei.value.reason == "bad_json"
    # minified: the next record is found too (a candidate must decode to a record, so turns never count)
    p2 = tmp_path / "corrupt_min.json"
    p2.write_text(json.dumps(GOOD).replace('"id": "b"', '"id": "b" oops', 1))
    convs, st = load_conversations("x", path=str(p2))
    assert [c.id for c in convs] == ["a", "c", "d"] and st.skipped == {"bad_json": 1}


def test_jsonl_with_malformed_line(tmp_path, caplog):
    lines = [json.dumps(r) for r in GOOD[:2]] + ['{"id": "broken", "conversations": [}', "",
                                                   json.dumps(GOOD[2])]
    p = write_jsonl(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="draftheads.data_prep"):
        convs, st = load_conversations("jl", path=str(p))
    assert [c.id for c in convs] == ["a", "b", "c"]
    assert st.skipped == {"bad_json": 1} and st.read == 4 and st.format == "jsonl"
    assert any("line 3" in r.getMessage() for r in caplog.records)
    check_accounting(st)
    with pytest.raises(DataError) as ei:
        load_conversations("jl", path=str(p), on_error="raise")
    assert str(p) in str(ei.value) and "line 3" in str(ei.value)
    assert ei.value.reason == "bad_json"


def test_jsonl_detected_without_extension_and_truncated_tail(tmp_path):
    text = "\n".join(json.dumps(r) for r in GOOD)
    p = tmp_path / "lines.json"
    p.write_text(text[:-10])  # last line cut, no trailing newline
    convs, st = load_conversations("x", path=str(p))
    assert st.format == "jsonl" and [c.id for c in convs] == ["a", "b", "c"] and st.truncated_tail


def test_wrapper_object_and_single_record(tmp_path):
    p = tmp_path / "wrap.json"
    p.write_text(json.dumps({"version": 2, "data": GOOD}, indent=1))
    convs, st = load_conversations("w", path=str(p))
    assert len(convs) == 4 and st.format == "json_object[data]"
    p2 = tmp_path / "wrap2.json"
    p2.write_text(json.dumps({"meta": {"n": 4}, "my_dialogs": GOOD}))
    convs, st = load_conversations("w", path=str(p2))
    assert len(convs) == 4 and st.format == "json_object[my_dialogs]"
    p3 = tmp_path / "one.json"
    p3.write_text(json.dumps(GOOD[1], indent=2))
    convs, st = load_conversations("w", path=str(p3))
    assert [c.id for c in convs] == ["b"] and st.format == "json_record"
    p4 = tmp_path / "wrapconv.json"  # wrapper key that is also a record key
    p4.write_text(json.dumps({"conversations": GOOD}))
    convs, st = load_conversations("w", path=str(p4))
    assert len(convs) == 4


def test_missing_empty_and_garbage_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_conversations("x", path=str(tmp_path / "nope.json"))
    (tmp_path / "empty.json").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_conversations("x", path=str(tmp_path / "empty.json"))
    (tmp_path / "garbage.json").write_text("\n\nhello world")
    with pytest.raises(DataError) as ei:
        load_conversations("x", path=str(tmp_path / "garbage.json"))
    assert "garbage.json" in str(ei.value) and "byte 2, line 3" in str(ei.value)
    write_jsonl(tmp_path / "allbad.jsonl", ["{nope", "[1,"])
    with pytest.raises(DataError, match="no complete record"):
        load_conversations("x", path=str(tmp_path / "allbad.jsonl"))
    (tmp_path / "bin.json").write_bytes(b"[\xff\xfe]")
    with pytest.raises(DataError, match="UTF-8"):
        load_conversations("x", path=str(tmp_path / "bin.json"))
    (tmp_path / "emptyarr.json").write_text("[]")
    convs, st = load_conversations("x", path=str(tmp_path / "emptyarr.json"))
    assert convs == [] and st.read == 0


def test_max_conversations_is_lazy(tmp_path):
    # 5 good records then garbage: asking for 3 must never reach the garbage
    text = json.dumps([sg(f"r{i}", ("human", "q"), ("gpt", "a")) for i in range(5)], indent=2)
    p = tmp_path / "lazy.json"
    p.write_text(text[:-2] + ", THIS IS NOT JSON" + "x" * 10000)
    convs, st = load_conversations("x", path=str(p), max_conversations=3)
    assert [c.id for c in convs] == ["r0", "r1", "r2"] and st.stopped_early
    assert load_conversations("x", path=str(p), max_conversations=0)[0] == []


def test_source_argument(tmp_path):
    p = write_array(tmp_path / "s.json", GOOD)
    convs, st = load_conversations(str(p))
    assert len(convs) == 4
    with pytest.raises(ValueError, match="unknown conversation source"):
        load_conversations("no_such_source")
    with pytest.raises(ValueError, match="on_error"):
        load_conversations(str(p), on_error="ignore")


# --------------------------------------------------------------------------- normalization

@pytest.mark.parametrize("raw,expected", [
    ("human", "user"), ("user", "user"), ("prompter", "user"), (" Human ", "user"), ("USER", "user"),
    ("gpt", "assistant"), ("GPT", "assistant"), ("assistant", "assistant"), ("chatgpt", "assistant"),
    ("ChatGPT", "assistant"), ("bard", "assistant"), ("bing", "assistant"), ("model", "assistant"),
    ("bot", "assistant"), ("Assistant\n", "assistant"),
])
def test_role_normalization(raw, expected):
    if expected == "user":
        rec = sg("r", (raw, "q"), ("gpt", "a"))
    else:
        rec = sg("r", ("human", "q"), (raw, "a"))
    conv, fixed = norm(rec)
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] and not fixed
    sys_conv, _ = norm(sg("r", (" System", "s"), ("human", "q"), ("gpt", "a")))
    assert sys_conv.messages[0] == {"role": "system", "content": "s"}


def test_openai_messages_with_list_content():
    rec = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "look at"},
                                     {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "this"}]},
        {"role": "assistant", "content": "nice", "tool_calls": None},
    ]}
    conv, fixed = norm(rec)
    assert conv.messages == [{"role": "system", "content": "sys"},
                             {"role": "user", "content": "look at\nthis"},
                             {"role": "assistant", "content": "nice"}]
    assert fixed == {"dropped_non_text_parts": 1}
    assert conv.id.startswith("sha1:")


def test_record_ids_are_deterministic():
    base = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert norm({**base, "id": "x1"})[0].id == "x1"
    assert norm({**base, "id": 17})[0].id == "17"
    assert norm({**base, "question_id": "q9"})[0].id == "q9"
    h1 = norm(base)[0].id
    h2 = norm(json.loads(json.dumps(base)))[0].id
    reordered = {"conversations": [{"value": "q", "from": "human"}, {"value": "a", "from": "gpt"}]}
    assert h1 == h2 == norm(reordered)[0].id and h1.startswith("sha1:")
    other = {"conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a"}]}
    assert norm(other)[0].id != h1


@pytest.mark.parametrize("record,reason", [
    ([1, 2], "not_an_object"),
    ("text", "not_an_object"),
    (sg("e"), "no_turns"),
    ({"id": "m", "text": "hi"}, "missing_field"),
    ({"id": "m", "conversations": [{"from": "human"}]}, "missing_field"),
    ({"id": "m", "conversations": [{"value": "x"}]}, "missing_field"),
    ({"id": "m", "conversations": "hi"}, "bad_type"),
    ({"id": "m", "conversations": ["hi"]}, "bad_type"),
    ({"id": "m", "conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "a"}]},
     "bad_type"),
    ({"id": "m", "conversations": [{"from": 1, "value": "q"}]}, "bad_type"),
    ({"id": ["m"], "conversations": []}, "bad_type"),
    (sg("u", ("human", "q"), ("tool", "{}"), ("gpt", "a")), "unknown_role"),
    (sg("n", ("human", "q"), ("human", "q2")), "no_assistant_turn"),
    (sg("n", ("system", "s"), ("human", "q"), ("gpt", " \n")), "no_assistant_turn"),
    (sg("g", ("gpt", "a"), ("gpt", "b")), "no_user_turn"),
    (sg("x", ("gpt", "a"), ("human", "q")), "no_exchange"),
    (sg("z", ("human", ""), ("gpt", "  ")), "empty_content"),
])
def test_bad_records(record, reason):
    with pytest.raises(DataError) as ei:
        normalize_record(record, 7)
    assert ei.value.reason == reason
    assert isinstance(ei.value, ValueError) and "record 7" in str(ei.value)


def test_unknown_role_skip_and_raise(tmp_path):
    recs = GOOD[:2] + [sg("weird", ("human", "q"), ("Narrator", "secret content"), ("gpt", "a"))]
    p = write_array(tmp_path / "u.json", recs)
    convs, st = load_conversations("u", path=str(p))
    assert len(convs) == 2 and st.skipped == {"unknown_role": 1}
    first = st.first_skip["unknown_role"]  # the summary says which roles exist, never the message text
    assert "expected one of" in first and "'human'" in first and "Narrator" in first and first in st.summary()
    assert "secret content" not in st.summary()
    with pytest.raises(DataError) as ei:
        load_conversations("u", path=str(p), on_error="raise")
    msg = str(ei.value)
    for part in (str(p), "record 2", "'weird'", "conversations[1].from", "'Narrator'", "expected"):
        assert part in msg, (part, msg)
    assert "secret content" not in msg
    assert ei.value.reason == "unknown_role" and ei.value.record_id == "weird"


def test_skip_reasons_counted_in_load(tmp_path):
    recs = GOOD + [sg("e"), sg("n", ("human", "q")), 42, {"id": "m"},
                   sg("z", ("human", ""), ("gpt", ""))]
    p = write_array(tmp_path / "mix.json", recs)
    convs, st = load_conversations("mix", path=str(p))
    assert st.kept == 4 and st.read == 9
    assert st.skipped == {"no_turns": 1, "no_assistant_turn": 1, "not_an_object": 1,
                          "missing_field": 1, "empty_content": 1}
    check_accounting(st)
    for c in convs:
        assert_well_formed(c)


def test_repairs_merge_trim_and_drop():
    rec = sg("fix",
             ("system", "s1"), ("system", "s2"),
             ("gpt", "leading answer"),          # before the first user turn -> dropped
             ("human", "q1"), ("human", "q1 more"),  # merged
             ("gpt", ""),                        # empty -> dropped
             ("gpt", "a1"),
             ("system", "late"),                 # late system -> dropped
             ("gpt", "a1 more"),                 # merged into a1
             ("human", "q2"), ("gpt", "a2"),
             ("human", "unanswered"))            # trailing user -> dropped
    conv, fixed = norm(rec)
    assert conv.messages == [
        {"role": "system", "content": "s1\n\ns2"},
        {"role": "user", "content": "q1\n\nq1 more"},
        {"role": "assistant", "content": "a1\n\na1 more"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert fixed == {"merged_system": 1, "trimmed_leading_assistant": 1, "merged_turns": 2,
                     "dropped_empty_turns": 1, "dropped_late_system": 1,
                     "dropped_trailing_user": 1}


def test_fixed_counts_reach_stats(tmp_path):
    p = write_array(tmp_path / "f.json", [sg("a", ("gpt", "x"), ("human", "q"), ("gpt", "a"))])
    convs, st = load_conversations("f", path=str(p))
    assert st.fixed == {"trimmed_leading_assistant": 1} and "trimmed_leading_assistant=1" in st.summary()


def test_logs_do_not_contain_content(tmp_path, caplog):
    recs = [sg("a", ("human", "SECRET-Q"), ("gpt", "SECRET-A")), sg("b", ("human", "SECRET-2")),
            sg("c", ("human", "q"), ("alien", "SECRET-3"))]
    p = write_array(tmp_path / "priv.json", recs)
    with caplog.at_level(logging.DEBUG, logger="draftheads.data_prep"):
        load_conversations("priv", path=str(p))
        split_conversations(load_conversations("priv", path=str(p))[0], 0.5)
    assert caplog.records
    assert not any("SECRET" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- split

def _convs(ids):
    return [Conversation(id=i, messages=[]) for i in ids]


def test_split_deterministic_and_order_independent():
    ids = [f"conv-{i}" for i in range(2000)]
    tr, ho = split_conversations(_convs(ids), 0.1, seed=0, by="id")
    assert len(tr) + len(ho) == 2000
    assert 150 <= len(ho) <= 250  # ~200 expected (binomial sd ~13)
    held = {c.id for c in ho}
    # reversed order, and a subset: the same ids land in the same split
    tr2, ho2 = split_conversations(_convs(ids[::-1]), 0.1, seed=0, by="id")
    assert {c.id for c in ho2} == held
    subset = ids[::7]
    _, ho3 = split_conversations(_convs(subset), 0.1, seed=0, by="id")
    assert {c.id for c in ho3} == held & set(subset)
    # order preserved within each part
    assert [c.id for c in tr] == [i for i in ids if i not in held]
    # another seed gives another split
    _, ho4 = split_conversations(_convs(ids), 0.1, seed=1, by="id")
    assert {c.id for c in ho4} != held


def test_split_duplicates_and_edges():
    ids = [f"x{i}" for i in range(300)]
    tr, ho = split_conversations(_convs(ids + ids), 0.5, seed=3, by="id")
    assert len(tr) + len(ho) == 600
    for part in (tr, ho):
        names = [c.id for c in part]
        assert all(names.count(n) == 2 for n in set(names))
    assert split_conversations(_convs(ids), 0.0)[1] == []
    assert split_conversations(_convs(ids), 1.0)[0] == []
    with pytest.raises(ValueError):
        split_conversations(_convs(ids), 1.5)


def _chat(cid, *turns):
    roles = ["user", "assistant"]
    return Conversation(id=cid, messages=[{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)])


def test_split_by_prompt_keeps_equal_openers_together():
    """ShareGPT repeats openers under different ids ("continue" ~40x in 1.2k distilled chats); a held-out
    "continue" whose answer was trained on inflated held-out τ. Keyed on the normalized opener, every copy
    (any id, case or spacing) lands on one side, for every seed."""
    variants = ["continue", "Continue", "  continue\n", "CONTINUE"]
    convs = [_chat(f"c{i}-{j}", v, f"answer {i} {j}") for i in range(50) for j, v in enumerate(variants)]
    convs += [_chat(f"u{i}", f"question number {i}", "a") for i in range(400)]
    for seed in range(20):
        tr, ho = split_conversations(convs, 0.3, seed=seed)
        assert len(tr) + len(ho) == len(convs)
        sides = {c.id.startswith("c") for c in ho}, {c.id.startswith("c") for c in tr}
        assert not (True in sides[0] and True in sides[1]), f"seed {seed}: 'continue' straddles the split"
        assert {prompt_key(c) for c in tr}.isdisjoint({prompt_key(c) for c in ho})
    # distinct openers still split at about the requested rate
    _, ho = split_conversations(convs[200:], 0.3, seed=0)
    assert 90 <= len(ho) <= 150  # ~120 expected (binomial sd ~9)
    # the prompt key ignores later turns, the id and whitespace/case, but not the words
    assert prompt_key(_chat("a", "Hello  World", "x")) == prompt_key(_chat("b", "hello world", "y", "more", "z"))
    assert prompt_key(_chat("a", "hello world", "x")) != prompt_key(_chat("a", "hello there", "x"))
    with pytest.raises(ValueError, match="split key"):
        split_conversations(convs, 0.1, by="title")


def test_dedupe_drops_normalized_repeats_and_keeps_the_first():
    convs = [_chat("a", "Hi", "Hello!"), _chat("b", "hi ", "hello!"), _chat("c", "hi", "Hello! How can I help?"),
             _chat("d", "hi", "hello!", "more", "x"), _chat("e", "HI", "HELLO!")]
    kept, dropped = dedupe_conversations(convs)
    assert [c.id for c in kept] == ["a", "c", "d"] and dropped == 2
    assert conversation_key(convs[0]) == conversation_key(convs[1])
    # a role change is a different conversation
    swapped = Conversation("f", [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hello!"}])
    assert conversation_key(swapped) != conversation_key(convs[0])


def test_a_record_extending_an_earlier_one_with_its_id_takes_its_place(tmp_path):
    """distill turns=all appends a longer record under the id of a first-turn one: the reader keeps only the
    longer, where the shorter stood; same-id records that do not extend each other are both kept."""
    recs = [sg("a", ("human", "q1"), ("gpt", "a1")), sg("b", ("human", "x"), ("gpt", "y")),
            sg("c", ("human", "c1"), ("gpt", "d1"), ("human", "c2"), ("gpt", "d2")),
            sg("a", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),  # extends a
            sg("c", ("human", "c1"), ("gpt", "d1")),  # a prefix of c: adds nothing
            sg("b", ("human", "x"), ("gpt", "other"))]  # same id, another answer: a duplicate id, kept
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps(r) for r in recs])
    convs, st = load_conversations("x", path=str(path))
    assert [c.id for c in convs] == ["a", "b", "c", "b"]
    assert [m["content"] for m in convs[0].messages] == ["q1", "a1", "q2", "a2"]
    assert len(convs[2].messages) == 4
    assert (st.kept, st.superseded, st.duplicate_ids, st.read) == (4, 2, 1, 6)
    check_accounting(st)
    assert "superseded by their extension: 2" in st.summary()


# --------------------------------------------------------------------------- embedded ShareGPT

def test_sharegpt_first_300_stops_early():
    """Reading stops after the records it needs (fewer than 400 of ~17.7k): that, not a wall-clock bound, is what
    keeps a small slice fast on a loaded machine."""
    convs, st = load_conversations("sharegpt", max_conversations=300)
    assert st.kept == 300 == len(convs) and st.stopped_early
    assert st.path == sharegpt_path() and st.format == "json_array"
    assert st.read < 400 and not st.truncated_tail
    for c in convs:
        assert_well_formed(c)
    assert len({c.id for c in convs}) == 300


@pytest.mark.slow
def test_sharegpt_full_file():
    t0 = time.perf_counter()
    convs, st = load_conversations("sharegpt")
    dt = time.perf_counter() - t0
    print(f"\nfull ShareGPT load: {dt:.2f}s\n{st.summary()}")
    assert st.truncated_tail
    assert abs(st.read - 17671) <= 20, st.read
    assert st.skipped.get("no_turns", 0) >= 100
    assert st.kept == len(convs) > 17000
    check_accounting(st)
    for c in convs[::50]:
        assert_well_formed(c)


# --------------------------------------------------------------------------- issue 24: no complete record lost

MANY = [sg(f"r{i}", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(6)]


def ids_of(path, on_error="skip"):
    convs, st = load_conversations("x", path=str(path), on_error=on_error)
    check_accounting(st)
    return [c.id for c in convs], st


def test_resync_when_the_error_is_the_newline_ending_the_bad_record(tmp_path):
    text = json.dumps(MANY, indent=2)
    # r2 lost its closing brace: the decoder fails only at the '{' that starts r3, after the newline
    end2 = text.index("}", text.index('"answer 2"') + 20)  # r2's own '}' (the turn's closes first)
    bad = text[:end2] + text[end2 + 1:]
    p = tmp_path / "nl.json"
    p.write_text(bad)
    got, st = ids_of(p)
    assert got == ["r0", "r1", "r3", "r4", "r5"] and st.skipped == {"bad_json": 1}


@pytest.mark.parametrize("where", [0, 3, 6])
def test_comment_line_inside_an_array_is_skipped_not_the_end(tmp_path, where):
    recs = [json.dumps(r, indent=2).replace("\n", "\n  ") for r in MANY]
    parts = ["  " + r for r in recs]
    if where < len(parts):
        parts[where] = "  // a comment someone left here\n" + parts[where]
    else:
        parts[-1] += "\n  // a comment someone left here"
    text = "[\n" + ",\n".join(parts) + "\n]\n"
    p = tmp_path / "comment.json"
    p.write_text(text)
    got, st = ids_of(p)
    assert got == [r["id"] for r in MANY] and st.skipped == {"bad_json": 1}, (got, st)
    with pytest.raises(DataError) as ei:
        load_conversations("x", path=str(p), on_error="raise")
    line = text[:text.index("//")].count("\n") + 1
    assert f"line {line}" in str(ei.value) and str(p) in str(ei.value)


def test_resync_whatever_the_indentation(tmp_path):
    recs = [json.dumps(r, indent=2) for r in MANY]
    # hand-edited file: records at different indentations, the broken one first on the '[' line
    body = ["[" + recs[0].replace('"r0"', '"r0" oops'), "    " + recs[1].replace("\n", "\n    "), recs[2],
            "\t" + recs[3].replace('"r3"', '"r3",,'), " " + recs[4], recs[5]]
    p = tmp_path / "indent.json"
    p.write_text(",\n".join(body) + "\n]")
    got, st = ids_of(p)
    assert got == ["r1", "r2", "r4", "r5"] and st.skipped == {"bad_json": 2}
    # minified: the next record is found too
    p2 = tmp_path / "min.json"
    p2.write_text(json.dumps(MANY).replace('"r1"', '"r1" oops', 1))
    got, st = ids_of(p2)
    assert got == ["r0", "r2", "r3", "r4", "r5"] and st.skipped == {"bad_json": 1}


def test_garbage_between_records_and_stray_brackets(tmp_path):
    recs = [json.dumps(r, indent=2) for r in MANY]
    text = ("[\n" + recs[0] + " ## junk ,\n" + recs[1] + "\n" + recs[2] + ",\n]\n" + recs[3] + ",\n[" + recs[4]
            + ",\n" + recs[5] + "\n]")
    p = tmp_path / "junk.json"
    p.write_text(text)
    got, st = ids_of(p)
    assert got == [r["id"] for r in MANY], (got, st)
    assert st.skipped.get("bad_json", 0) >= 3


@pytest.mark.parametrize("layout", ["array", "jsonl"])
def test_non_utf8_byte_drops_only_its_record(tmp_path, layout, caplog):
    if layout == "array":
        text = json.dumps(MANY, indent=2)
        p = tmp_path / "bad.json"
    else:
        text = "".join(json.dumps(r) + "\n" for r in MANY)
        p = tmp_path / "bad.jsonl"
    at = text.index("answer 3") + 2
    data = text[:at].encode() + b"\xff\xfe" + text[at:].encode()
    p.write_bytes(data)
    line = text[:at].count("\n") + 1
    with caplog.at_level(logging.WARNING, logger="draftheads.data_prep"):
        got, st = ids_of(p)
    assert got == ["r0", "r1", "r2", "r4", "r5"] and st.skipped == {"bad_encoding": 1}, (got, st)
    assert any(f"line {line}" in r.getMessage() and "UTF-8" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    with pytest.raises(DataError) as ei:
        load_conversations("x", path=str(p), on_error="raise")
    assert f"line {line}" in str(ei.value) and str(p) in str(ei.value) and "UTF-8" in str(ei.value)
    assert ei.value.reason == "bad_encoding"


def test_non_utf8_line_number_far_into_a_jsonl_file(tmp_path):
    lines = [json.dumps(sg(f"q{i}", ("human", f"q{i} " + "é" * (i % 7) + "x" * (i * 37 % 500)), ("gpt", "ok"))) for i in range(200)]
    data = "".join(ln + "\n" for ln in lines).encode()
    off = sum(len(ln.encode()) + 1 for ln in lines[:149]) + 30  # inside line 150
    p = tmp_path / "far.jsonl"
    p.write_bytes(data[:off] + b"\x80" + data[off:])
    with pytest.raises(DataError, match=r"line 150\b"):
        load_conversations("x", path=str(p), on_error="raise")
    got, st = ids_of(p)
    assert len(got) == 199 and "q149" not in got and st.skipped == {"bad_encoding": 1}


# --------------------------------------------------------------------------- property: corruption between records

from hypothesis import HealthCheck, given, settings, strategies as hst  # noqa: E402

_JUNK = hst.lists(hst.one_of(hst.sampled_from(list('{}[],:"\\/#*-+.0123456789abcxyz \t\n\r')),
                             hst.sampled_from(["//", "/* c */", "null", "true", '{"a": ', '"id": ', '[{', "\\u12",
                                               "\x00", "é", "☃"]),
                             hst.binary(min_size=1, max_size=2).filter(lambda b: b[0] >= 0x80)),
                  min_size=1, max_size=8)


def _junk_bytes(parts) -> bytes:
    return b"".join(x if isinstance(x, bytes) else x.encode() for x in parts)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=hst.integers(1, 5), layout=hst.sampled_from(["indent2", "indent0", "tab", "minified", "jsonl"]),
       gaps=hst.dictionaries(hst.integers(0, 5), hst.tuples(_JUNK, hst.booleans()), min_size=1, max_size=3),
       tricky=hst.booleans())
def test_property_corruption_between_records_loses_no_untouched_record(tmp_path, n, layout, gaps, tricky):
    text = 'a {b} "c", [d]\n},\n  {' if tricky else "plain"
    gaps = {k % (n + 1): v for k, v in gaps.items()}  # gap i: before record i (n: after the last)
    recs = [sg(f"id{i}", ("human", f"q{i} {text}"), ("gpt", f"a{i} {text}")) for i in range(n)]
    if layout == "jsonl":
        chunks = [json.dumps(r).encode() for r in recs]
        out = b""
        for i in range(n + 1):
            if i in gaps:
                out += _junk_bytes(gaps[i][0]) + b"\n"
            if i < n:
                out += chunks[i] + b"\n"
        p = tmp_path / "prop.jsonl"
    else:
        indent = {"indent2": 2, "indent0": 0, "tab": "\t", "minified": None}[layout]
        chunks = [json.dumps(r, indent=indent).encode() for r in recs]
        sep = b"," if indent is None else b",\n"
        out = b"[" if indent is None else b"[\n"
        for i in range(n + 1):
            junk = _junk_bytes(gaps[i][0]) if i in gaps else b""
            before_comma = gaps[i][1] if i in gaps else False
            if i == 0:
                out += junk
            elif i < n:
                out += (junk + sep) if before_comma else (sep + junk)
            else:
                out += junk
            if i < n:
                out += chunks[i]
        out += b"\n]\n"
        p = tmp_path / "prop.json"
    p.write_bytes(out)
    convs, st = load_conversations("p", path=str(p))
    got = [c.id for c in convs]
    want = iter(got)
    assert all(r["id"] in want for r in recs), (got, out)  # every untouched record, in order
    assert len(got) == n, (got, out)
    check_accounting(st)
    # a lone ',' after the last record is a trailing comma: tolerated with a warning, nothing to count
    counted = {i: j for i, (j, _) in gaps.items() if _junk_bytes(j).strip() not in (b"", b",") or i < n or layout == "jsonl"}
    if any(_junk_bytes(j).strip() for j in counted.values()):
        assert st.n_skipped >= 1 or st.truncated_tail, (st, out)
