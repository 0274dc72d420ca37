"""Self-distillation job: one greedy answer per distinct prompt, training-split prompts only, resumable after a
killed write, and the prepared distilled set keeps repeated prompts out of its held-out split."""

from __future__ import annotations

import json

from conftest import compose
from data_prep.dataset import prepare_data
from data_prep.distill import main as distill_main
from data_prep.sources import Conversation, load_conversations, prompt_key, split_conversations


def _chats(path):
    """60 distinct prompts, plus 3 × 10 copies of ShareGPT-style openers under fresh ids and spellings."""
    recs = [{"id": f"q{i}", "conversations": [{"from": "human", "value": f"please list item {i} and {i + 1}"},
                                              {"from": "gpt", "value": f"item {i} item {i + 1}"}]} for i in range(60)]
    for j, opener in enumerate(["continue", "Please continue", "hi"]):
        for k in range(10):
            spelled = opener.upper() if k % 2 else f" {opener} "
            recs.append({"id": f"dup{j}-{k}", "conversations": [{"from": "human", "value": spelled},
                                                                {"from": "gpt", "value": f"original answer {k}"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _cfg(target_dir, data_file, out, *extra):
    return compose("distill", ["target=hf", f"target.name={target_dir}", "target.dtype=fp32",
                               "target.local_files_only=true", "data=file", f"data.path={data_file}",
                               "data.heldout_fraction=0.2", "num_conversations=null", "batch_size=8",
                               "max_new_tokens=3", "device=cpu", f"out={out}", *extra])


def _records(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_greedy_distill_answers_each_prompt_once_and_only_training_prompts(tmp_path, tiny_target_dir):
    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "distilled.jsonl"
    s = distill_main(_cfg(tiny_target_dir, data, out))
    recs = _records(out)
    keys = [prompt_key(Conversation(r["id"], r["messages"])) for r in recs]
    assert len(keys) == len(set(keys)), "a repeated prompt was distilled twice"

    convs, _ = load_conversations("file", str(data))
    train, held = split_conversations(convs, 0.2, 0)
    train_keys, held_keys = {prompt_key(c) for c in train}, {prompt_key(c) for c in held}
    assert held_keys and set(keys) == train_keys  # every distinct training prompt once, no held-out prompt
    n_dup_train = sum(1 for c in train) - len(train_keys)
    assert s["written"] == len(train_keys) and s["skipped_duplicate_prompt"] == n_dup_train > 0
    assert all(r["messages"][-1]["role"] == "assistant" and r["distill"]["temperature"] == 0.0 for r in recs)

    # a killed job: the last record half written; the rerun repairs it, redoes only it, and never duplicates
    text = out.read_text()
    out.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    s2 = distill_main(_cfg(tiny_target_dir, data, out))
    recs2 = _records(out)
    assert s2["written"] == 1 and s2["already_done"] == len(recs) - 1
    assert sorted(r["id"] for r in recs2) == sorted(r["id"] for r in recs)
    assert recs2[-1] == recs[-1]  # greedy: the redone record is the same record
    s3 = distill_main(_cfg(tiny_target_dir, data, out))
    assert s3["written"] == 0 and _records(out) == recs2


def test_sampled_distill_keeps_repeated_prompts(tmp_path, tiny_target_dir):
    """With temperature > 0 each copy gets its own sample: repeats are data, not duplicates."""
    data = _chats(tmp_path / "chats.jsonl")
    s = distill_main(_cfg(tiny_target_dir, data, tmp_path / "sampled.jsonl", "temperature=1.0"))
    convs, _ = load_conversations("file", str(data))
    train, _ = split_conversations(convs, 0.2, 0)
    assert s["skipped_duplicate_prompt"] == 0 and s["written"] == len(train)


def test_prepared_distilled_data_dedupes_and_holds_out_whole_prompts(tmp_path, tiny_target_dir):
    """Preparing a file with repeated first-turn chats: exact repeats are dropped (counted), and no held-out
    question's prompt appears in the training rows, for several split seeds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    recs = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": f"answer {i}"}]} for i in range(80)]
    recs += [{"id": f"c{k}", "messages": [{"role": "user", "content": "continue" if k % 2 else "Continue"},
                                          {"role": "assistant", "content": "the same answer"}]} for k in range(20)]
    opener = {r["id"]: r["messages"][0]["content"] for r in recs}
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    held_sizes = []
    for seed in range(6):
        cfg = compose("distill", ["data=distilled", f"data.path={path}", "data.max_length=64",
                                  "data.heldout_fraction=0.25", f"data.split_seed={seed}",
                                  f"data.cache_dir={tmp_path / 'cache'}"]).data
        d = prepare_data(cfg, tok)
        assert d.stats["split"]["duplicates_dropped"] == 19 and d.stats["split"]["by"] == "prompt"
        assert d.stats["split"]["heldout_openers_in_train"] == 0
        assert len(d.train) + len(d.heldout) == 81
        questions = [json.loads(line)["turns"][0] for line in d.heldout_questions.read_text().splitlines()]
        train_prompts = {opener[i].casefold() for i in d.train["id"]}
        assert train_prompts.isdisjoint(q.casefold() for q in questions), f"seed {seed}: a held-out prompt trained on"
        held_sizes.append(len(questions))
    assert 0 < sum(held_sizes) < 6 * 81  # held-out splits are non-trivial
    # the id split is still there; without dedupe its held-out split shares openers with training, and says so
    leaks = []
    for seed in range(6):
        cfg = compose("distill", ["data=distilled", f"data.path={path}", "data.max_length=64", "data.split_by=id",
                                  "data.dedupe=false", "data.heldout_fraction=0.25", f"data.split_seed={seed}",
                                  f"data.cache_dir={tmp_path / 'cache'}"]).data
        d = prepare_data(cfg, tok)
        st = d.stats["split"]
        assert st["by"] == "id" and st["duplicates_dropped"] == 0
        leaks.append(st["heldout_openers_in_train"])
        cats = [json.loads(line)["category"] for line in d.heldout_questions.read_text().splitlines()]
        assert cats.count("sharegpt-heldout-opener-in-train") == st["heldout_openers_in_train"]  # reported apart
    assert sum(leaks) > 0


def test_heldout_rows_come_in_hash_order_whatever_the_file_order(tmp_path, tiny_target_dir):
    """The distill job writes batches sorted by prompt length; the trainer's simulated τ (first rows) and eval's
    max_questions read a prefix of the held-out split. That prefix must sample the split, not its shortest prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    # file order = prompt order (r0 first), as a distill job's length-sorted batches would give
    recs = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i:03d}"},
                                         {"role": "assistant", "content": f"answer {i}"}]} for i in range(120)]
    orders = {}
    for name, rs in (("sorted", recs), ("reversed", recs[::-1])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rs))
        cfg = compose("distill", ["data=distilled", f"data.path={path}", "data.max_length=256",
                                  "data.heldout_fraction=0.3", f"data.cache_dir={tmp_path / 'cache'}"]).data
        d = prepare_data(cfg, tok)
        qids = [json.loads(line)["question_id"] for line in d.heldout_questions.read_text().splitlines()]
        assert list(d.heldout["id"]) == qids  # rows and questions share the order
        orders[name] = qids
    assert orders["sorted"] == orders["reversed"] and len(orders["sorted"]) >= 20
    lengths = [int(q[1:]) for q in orders["sorted"]]
    assert lengths != sorted(lengths) and lengths != sorted(lengths, reverse=True)
    first = lengths[: len(lengths) // 4]  # a prefix spans the split, not one end of it
    assert min(first) < 40 and max(first) > 80



def test_distill_records_the_attention_kernel_that_ran(tmp_path, tiny_target_dir):
    data = _chats(tmp_path / "chats.jsonl")
    s_sdpa = distill_main(_cfg(tiny_target_dir, data, tmp_path / "a.jsonl", "num_conversations=4"))
    s_eager = distill_main(_cfg(tiny_target_dir, data, tmp_path / "b.jsonl", "num_conversations=4",
                                "target.attn_implementation=eager"))
    assert s_sdpa["attn_implementation"] == "sdpa" and s_eager["attn_implementation"] == "eager"
    assert s_sdpa["written"] == s_eager["written"] == 4
    # fp32: the two kernels give the same greedy answers on the tiny target
    assert _records(tmp_path / "a.jsonl") == _records(tmp_path / "b.jsonl")
