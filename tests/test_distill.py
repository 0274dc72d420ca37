"""Self-distillation job: one greedy answer per distinct prompt, training-split prompts only, resumable after a
killed write, and the prepared distilled set keeps repeated prompts out of its held-out split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import compose
from draftheads.data_prep.dataset import prepare_data
from draftheads.data_prep.distill import main as distill_main
from draftheads.data_prep.sources import Conversation, load_conversations
from draftheads.data_prep.splits import prompt_key, split_conversations
from draftheads.data_prep.template import prompt_ids
from draftheads.heads.target import load_target


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


def test_shards_together_write_what_one_job_writes(tmp_path, tiny_target_dir, monkeypatch):
    """shard=i/n (or a launcher's RANK/WORLD_SIZE): each process distills its own part into its own file, the parts
    are disjoint, repeated prompts stay in one shard (each answered once overall), the shard files together hold
    exactly the records of one unsharded job, and num_conversations is shared out. A bad spec is a user error."""
    from draftheads.data_prep.shards import parse_shard

    data = _chats(tmp_path / "chats.jsonl")
    distill_main(_cfg(tiny_target_dir, data, tmp_path / "one.jsonl"))
    whole = {r["id"]: r for r in _records(tmp_path / "one.jsonl")}
    parts = []
    for i in range(3):
        s = distill_main(_cfg(tiny_target_dir, data, tmp_path / "d.jsonl", f"shard={i}/3"))
        assert s["out"] == str(tmp_path / f"d.shard{i}of3.jsonl") and s["shard"] == f"{i}/3"
        parts.append({r["id"]: r for r in _records(tmp_path / f"d.shard{i}of3.jsonl")})
    assert all(len(p) >= 5 for p in parts) and sum(map(len, parts)) == len(whole)  # disjoint, none empty
    assert {k: v for p in parts for k, v in p.items()} == whole  # fp32 greedy: the same records
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    again = distill_main(_cfg(tiny_target_dir, data, tmp_path / "d.jsonl"))  # shard=auto under a launcher: resumes 1/3
    assert again["shard"] == "1/3" and again["written"] == 0 and again["already_done"] == len(parts[1])
    limited = distill_main(_cfg(tiny_target_dir, data, tmp_path / "few.jsonl", "num_conversations=10"))
    assert limited["written"] == 4  # ceil(10 / 3) for this shard
    assert parse_shard("auto", {}) == (0, 1) and parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="shard must be auto or i/n with 0 <= i < n"):
            parse_shard(bad)


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


# ---- the slot engine (static KV cache, continuous batching), multi-turn, sampling, coverage, eval guard

def _multi_turn_chats(path, n=9):
    """n conversations of 1-3 user turns with words from the tiny tokenizer's corpus."""
    words = "one two three four five six seven eight nine ten cat dog red blue green".split()
    recs = []
    for i in range(n):
        turns = []
        for t in range(1 + i % 3):
            ask = f"please count {words[(i + t) % 15]} " + " ".join(words[: 1 + (i * 7 + t) % 12])
            turns += [{"from": "human", "value": ask},
                      {"from": "gpt", "value": f"original answer {i}.{t}"}]
        recs.append({"id": f"m{i}", "conversations": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_slot_decoder_batched_greedy_equals_unbatched_generate_fp32(tiny_target_dir, tiny_qwen2_dir):
    """Token for token: 9 prompts of 3-40 tokens through 4 cache rows (refilled, rows moved down as they retire)
    against Hugging Face generate on each prompt alone, for a Llama and a Qwen2 (biased q/k/v) target; refills
    prefilled alone or inside the next decode step (``step``), where the refilled row also decodes a stale token."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from draftheads.data_prep.fastgen import SlotDecoder

    for d in (tiny_target_dir, tiny_qwen2_dir):
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 41))] for _ in range(9)]
        new = [4 + 3 * (i % 4) for i in range(9)]  # ragged answer lengths: rows retire at different steps
        ref = [m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
               for p, n in zip(prompts, new)]
        for groups, attention, merged in ((1, "matmul", False), (4, "matmul", False), (1, "sdpa", False),
                                          (4, "sdpa", False), (1, "matmul", True), (4, "sdpa", True)):
            dec = SlotDecoder(m, 4, 64, attention)
            dec.GROUPS, dec.GROUP_GAIN = groups, 1
            plan, sizes = dec._plan, []
            dec._plan = lambda lens, S: sizes.append(len(pl := plan(lens, S))) or pl  # noqa: B023
            queue, row_of, got, pend = list(range(9)), [None] * 4, {}, {}  # pend: row -> prompt in the next step

            def start(i):
                j = queue.pop(0)
                row_of[i] = j
                if merged:  # prefilled inside the next decode step, where row i also decodes a stale token
                    pend[i] = j
                else:
                    got[j] = [int(dec.prefill(i, prompts[j]).argmax())]

            for i in range(4):
                row_of[i] = queue.pop(0)
                got[row_of[i]] = [int(dec.prefill(i, prompts[row_of[i]]).argmax())]
            width, moves, rode = 4, 0, 0
            while width:
                jobs = [(i, prompts[j], 0) for i, j in sorted(pend.items())]
                last = [got[row_of[i]][-1] if i not in pend else 1 for i in range(width)]
                logits, first = dec.step(torch.tensor(last), jobs)
                nxt = logits.argmax(-1).tolist()
                for i in range(width):
                    if i not in pend:
                        got[row_of[i]].append(nxt[i])
                for (i, _, _), lg in zip(jobs, first):
                    got[pend.pop(i)] = [int(lg.argmax())]
                    rode += 1
                for i in reversed(range(width)):
                    if i not in pend and len(got[row_of[i]]) == new[row_of[i]]:
                        if queue:
                            start(i)
                        else:
                            width -= 1
                            if i != width:
                                dec.move(width, i)
                                row_of[i] = row_of[width]
                                if width in pend:
                                    pend[i] = pend.pop(width)
                                moves += 1
            assert moves > 0 and (max(sizes) > 1) == (groups > 1)  # the grouped path ran when allowed
            assert (rode > 0) == merged
            assert [got[j] for j in range(9)] == ref, (d, groups, attention, merged)


def test_every_turn_is_answered_on_the_targets_own_earlier_answers(tmp_path, tiny_target_dir):
    """turns=all: each record holds the target's answers to every user turn, and each later answer is the
    target's greedy reply to a history holding its own earlier answers (checked against unbatched generate).
    The batched slot engine writes exactly the records of the unbatched (batch 1) generate engine, and later
    turns reuse the cached conversation instead of prefilling it again."""
    import torch

    data = _multi_turn_chats(tmp_path / "multi.jsonl")
    common = ["turns=all", "max_new_tokens=6", "data.heldout_fraction=0.0"]
    s = distill_main(_cfg(tiny_target_dir, data, tmp_path / "slots.jsonl", *common, "engine=slots", "batch_size=4"))
    h = distill_main(_cfg(tiny_target_dir, data, tmp_path / "hf.jsonl", *common, "engine=hf", "batch_size=1"))
    a = distill_main(_cfg(tiny_target_dir, data, tmp_path / "apart.jsonl", *common, "engine=slots", "batch_size=4",
                          "refill=separate"))
    recs = {r["id"]: r for r in _records(tmp_path / "slots.jsonl")}
    assert {r["id"]: r for r in _records(tmp_path / "hf.jsonl")} == recs  # batched == unbatched, every turn
    assert {r["id"]: r for r in _records(tmp_path / "apart.jsonl")} == recs  # refills merged or apart: the same
    assert s["written"] == h["written"] == 9 and s["turns_answered"] == 3 + 3 * 2 + 3 * 3 == 18
    assert s["engine_stats"]["reused_tokens"] == a["engine_stats"]["reused_tokens"] > 0  # later turns: suffix only
    assert s["engine_stats"]["prefill_tokens"] == a["engine_stats"]["prefill_tokens"]
    # the first 4 rows are prefilled in forwards of their own; merged, every later turn and conversation rode a step
    assert s["engine_stats"]["prefills_in_decode_steps"] == 18 - 4
    assert a["engine_stats"]["prefills_in_decode_steps"] == 0

    target = load_target({"name": str(tiny_target_dir), "dtype": "fp32"})
    tok = target.tokenizer
    checked = 0
    for r in recs.values():
        msgs = r["messages"]
        users = [m["content"] for m in msgs if m["role"] == "user"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * len(users)
        assert not any(m["content"].startswith("original answer") for m in msgs if m["role"] == "assistant")
        for k in range(1, len(msgs), 2):  # the reply to msgs[:k] given the distilled history before it
            ids = prompt_ids(tok, msgs[:k])
            out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                                        eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
            out = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
            assert tok.decode(out, skip_special_tokens=True) == msgs[k]["content"]
            checked += k > 1
    assert checked == 9  # 3 two-turn + 3 × 2 three-turn later answers


def test_turns_all_extends_a_first_turn_file_to_what_a_fresh_all_turns_run_writes(tmp_path, tiny_target_dir):
    """A turns=first file, then turns=all on it: the first answers are kept (not generated again), the later
    turns are asked after them, and what the file reads as equals a from-scratch turns=all run, record for record,
    greedy (both engines) and sampled (each turn's seed is its turn number in the conversation). The extended
    records are appended; the reader keeps the longer one, so prepared data has one row per conversation."""
    data = _multi_turn_chats(tmp_path / "multi.jsonl")
    common = ["max_new_tokens=6", "data.heldout_fraction=0.0", "batch_size=4"]
    read = lambda p: {c.id: c.messages for c in load_conversations("x", path=str(p))[0]}  # noqa: E731
    for name, extra in {"slots": ["engine=slots"], "hf": ["engine=hf", "batch_size=1"],
                        "sampled": ["engine=slots", "temperature=0.7", "seed=3"]}.items():
        fresh, grown = tmp_path / f"{name}-fresh.jsonl", tmp_path / f"{name}-grown.jsonl"
        distill_main(_cfg(tiny_target_dir, data, fresh, *common, *extra, "turns=all"))
        first = distill_main(_cfg(tiny_target_dir, data, grown, *common, *extra, "turns=first"))
        assert first["written"] == 9 and first["turns_answered"] == 9
        firsts = {r["id"]: r["messages"] for r in _records(grown)}
        s = distill_main(_cfg(tiny_target_dir, data, grown, *common, *extra, "turns=all"))
        assert (s["written"], s["extended"], s["already_done"], s["turns_answered"]) == (6, 6, 9, 3 * 1 + 3 * 2)
        assert read(grown) == read(fresh), name  # the same conversations, whatever order the jobs wrote them in
        assert all(read(grown)[k][:len(m)] == m for k, m in firsts.items())  # the first answers were kept
        recs = _records(grown)
        assert len(recs) == 15 and all(len(r["distill"]["turn_finish"]) == sum(x["role"] == "user" for x in
                                                                                r["messages"]) for r in recs)
        again = distill_main(_cfg(tiny_target_dir, data, grown, *common, *extra, "turns=all"))
        assert again["written"] == 0 and again["left_to_do"] == 0
    other = distill_main(_cfg(tiny_target_dir, data, tmp_path / "slots-grown.jsonl", *common, "turns=all",
                              "temperature=0.7"))  # a sampled job does not extend greedy records: counted, not written
    assert other["written"] == 0 and other["skipped_not_extendable"] == 0  # every greedy record is already whole
    first = tmp_path / "first-only.jsonl"
    distill_main(_cfg(tiny_target_dir, data, first, *common, "turns=first"))
    other = distill_main(_cfg(tiny_target_dir, data, first, *common, "turns=all", "temperature=0.7"))
    assert other["written"] == 0 and other["extended"] == 0 and other["skipped_not_extendable"] == 6
    grown = tmp_path / "slots-grown.jsonl"
    prepared = prepare_data({"name": "grown", "source": "file", "path": str(grown), "heldout_fraction": 0.0,
                             "cache_dir": str(tmp_path / "cache")}, load_target({"name": str(tiny_target_dir),
                                                                                 "dtype": "fp32"}).tokenizer)
    assert len(prepared.train) == 9 and prepared.stats["load"]["superseded"] == 6


def test_sampling_is_seeded_reproducible_whatever_the_batch_and_differs_from_greedy(tmp_path, tiny_target_dir):
    data = _multi_turn_chats(tmp_path / "multi.jsonl")
    common = ["turns=all", "max_new_tokens=8", "data.heldout_fraction=0.0", "engine=slots"]
    runs = {}
    for name, extra in {"a": ["temperature=0.7", "seed=1", "batch_size=4"],
                        "b": ["temperature=0.7", "seed=1", "batch_size=7"],
                        "c": ["temperature=0.7", "seed=2", "batch_size=4"],
                        "apart": ["temperature=0.7", "seed=1", "batch_size=4", "refill=separate"],
                        "greedy": ["batch_size=4"]}.items():
        distill_main(_cfg(tiny_target_dir, data, tmp_path / f"{name}.jsonl", *common, *extra))
        runs[name] = {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"]
                      for r in _records(tmp_path / f"{name}.jsonl")}
    assert len(runs["a"]) == 9 and runs["a"] == runs["b"] == runs["apart"]  # same seed, other batch: same samples
    answers = lambda run: [a for k in sorted(run) for a in run[k]]  # noqa: E731
    n = len(answers(runs["a"]))
    assert n == 18
    differ_greedy = sum(x != y for x, y in zip(answers(runs["a"]), answers(runs["greedy"])))
    differ_seed = sum(x != y for x, y in zip(answers(runs["a"]), answers(runs["c"])))
    assert differ_greedy >= n // 2 and differ_seed >= n // 2, (differ_greedy, differ_seed)


def test_prompt_kind_coverage_counts_are_exact(tmp_path, tiny_target_dir):
    from draftheads.data_prep.prompt_kinds import KINDS, kind_counts, prompt_kind

    toy = {"Translate 'good morning' into French": "translation",
           "Please summarize this article in three bullet points": "summarization",
           "Extract all dates mentioned in the text below": "extraction",
           "Write a Python function that reverses a list": "code",
           "Fix this bug:\n```js\nlet x = 1\n```": "code",
           "Calculate 17 * 23 and explain each step": "math",
           "Solve the equation 2x + 3 = 11": "math",
           "Write a short poem about autumn leaves": "writing",
           "Compose an email to my landlord about the heating": "writing",
           "What is the capital of Australia?": "qa",
           "Why is the sky blue": "qa",
           "hello there": "other",
           "continue": "other"}
    assert {t: prompt_kind(t) for t in toy} == toy
    assert kind_counts(toy) == {"translation": 1, "summarization": 1, "extraction": 1, "code": 2, "math": 2,
                                "writing": 2, "qa": 2, "other": 2}
    assert tuple(kind_counts([])) == KINDS
    # the job's summary counts the first user message of each record written
    path = tmp_path / "kinds.jsonl"
    path.write_text("".join(json.dumps({"id": f"k{i}", "conversations": [
        {"from": "human", "value": t}, {"from": "gpt", "value": "x"}, {"from": "human", "value": "Translate it"},
        {"from": "gpt", "value": "y"}]}) + "\n" for i, t in enumerate(toy)))
    s = distill_main(_cfg(tiny_target_dir, path, tmp_path / "k.jsonl", "turns=all", "data.heldout_fraction=0.0"))
    assert s["written"] == 13 and s["prompt_kinds"] == kind_counts(toy)
    assert json.loads((tmp_path / "k.jsonl.summary.json").read_text())["prompt_kinds"] == s["prompt_kinds"]


def test_eval_questions_are_never_distilled(tmp_path, tiny_target_dir):
    import pytest

    questions = tmp_path / "mt_bench.jsonl"
    questions.write_text(json.dumps({"question_id": 81, "category": "writing",
                                     "turns": ["Please list item 3 and 4", "Now in reverse"]}) + "\n")
    data = _chats(tmp_path / "chats.jsonl")  # holds "please list item 3 and 4" (other case) as q3
    s = distill_main(_cfg(tiny_target_dir, data, tmp_path / "d.jsonl", "data.heldout_fraction=0.0",
                          f"eval_questions=[{questions}]"))
    ids = {r["id"] for r in _records(tmp_path / "d.jsonl")}
    assert s["skipped_eval_prompt"] == 1 and "q3" not in ids and "q4" in ids
    assert s["eval_question_files"] == [str(questions)] and s["eval_prompts_excluded"] == 2
    with pytest.raises(ValueError, match="eval question"):  # the question file itself as the prompt source
        distill_main(_cfg(tiny_target_dir, questions, tmp_path / "e.jsonl", f"eval_questions=[{questions}]"))
    with pytest.raises(ValueError, match="MT-bench format"):  # any MT-bench-format file, listed or not
        distill_main(_cfg(tiny_target_dir, questions, tmp_path / "e.jsonl", "eval_questions=[]"))


def test_max_minutes_stops_between_conversations_and_a_rerun_goes_on(tmp_path, tiny_target_dir):
    from draftheads.data_prep.distill_engines import until

    ticks = iter(range(100))
    assert list(until("abcdef", 2.5, clock=lambda: float(next(ticks)))) == ["a", "b", "c"]  # 0, 1, 2 <= 2.5
    assert list(until("abc", None)) == ["a", "b", "c"]
    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "distilled.jsonl"
    s = distill_main(_cfg(tiny_target_dir, data, out, "max_minutes=1e-9"))  # past the deadline at once
    assert s["written"] == 0 and s["stopped_at_max_minutes"] and s["left_to_do"] > 0
    s2 = distill_main(_cfg(tiny_target_dir, data, out))
    assert s2["written"] == s["left_to_do"] and not s2["stopped_at_max_minutes"] and s2["left_to_do"] == 0
    import pytest

    with pytest.raises(ValueError, match="max_minutes"):
        distill_main(_cfg(tiny_target_dir, data, out, "max_minutes=-1"))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 40), old=st.integers(1, 12), cap=st.integers(1, 12), D=st.integers(1, 3))
def test_relayout_in_place_keeps_every_block(n, old, cap, D):
    """The KV cache's in-place re-layout (fastgen._relayout): after growing or shrinking the per-block capacity,
    every block's first min(old, cap) rows hold what they held, with no second buffer."""
    import torch

    from draftheads.data_prep.fastgen import _relayout

    buf = torch.full((n * max(old, cap) * D,), float("nan"))
    buf[:n * old * D] = torch.arange(n * old * D, dtype=torch.float32)
    before = buf[:n * old * D].view(n, old, D).clone()
    _relayout(buf, n, old, cap, D)
    keep = min(old, cap)
    assert torch.equal(buf[:n * cap * D].view(n, cap, D)[:, :keep], before[:, :keep])


def test_prompts_are_sorted_by_length_within_blocks_of_the_split_order(tmp_path, tiny_target_dir):
    """sort_block=k: each run of k prompts (in the split's order) is sorted by prompt length, so a job cut short by
    max_minutes has seen long and short prompts alike; null sorts the whole selection; 0 is refused by name."""
    import pytest

    from draftheads.data_prep.distill import select_prompts
    from draftheads.data_prep.template import ensure_chat_template

    recs = [{"id": f"q{i}", "conversations": [{"from": "human", "value": " ".join(["item"] * (1 + (7 * i) % 23))},
                                              {"from": "gpt", "value": "ok"}]} for i in range(40)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = load_target({"name": str(tiny_target_dir), "dtype": "fp32"}).tokenizer
    ensure_chat_template(tok)

    def order(block):
        cfg = _cfg(tiny_target_dir, data, tmp_path / "o.jsonl", f"sort_block={block}")
        todo, _ = select_prompts(cfg, tok, {}, set())
        return [(c.id, len(prompt_ids(tok, s + [{"role": "user", "content": u[0]}]))) for c, s, u in todo]

    whole, blocks = order("null"), order(5)
    assert [n for _, n in whole] == sorted(n for _, n in whole)
    assert sorted(whole) == sorted(blocks) and [n for _, n in blocks] != [n for _, n in whole]
    for b in range(0, len(blocks), 5):
        chunk = [n for _, n in blocks[b:b + 5]]
        assert chunk == sorted(chunk)
    assert max(n for _, n in blocks[:5]) > whole[4][1]  # the first block is not just the five shortest prompts
    with pytest.raises(ValueError, match="sort_block"):
        order(0)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(2, 300), levels=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_greedy_pick_on_bf16_logits_is_the_fp32_argmax(rows, vocab, levels, seed):
    """The slot engine returns logits in the model's dtype; the greedy pick on them is the argmax of their exact
    fp32 upcast, ties included (first maximum), for any row count, vocabulary and number of distinct values."""
    import torch

    from draftheads.data_prep.fastgen import sample_next

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, levels, (rows, vocab), generator=g).float() / 3).to(torch.bfloat16)  # many ties
    got = sample_next(logits, 0.0, 0, 1.0, [None] * rows)
    assert torch.equal(got, logits.float().argmax(-1))


def test_keys_read_per_cached_counts_the_padding_attention_reads(tiny_target_dir):
    """The summary's attention_keys_read_per_cached: one row of 10 cached tokens decoding 3 steps reads the whole
    64-position capacity each step (3 x 64 keys) for 11 + 12 + 13 keys it holds; the logits keep the model's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from draftheads.data_prep.fastgen import SlotDecoder, describe

    m = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    dec = SlotDecoder(m, 1, 64)
    nxt = dec.prefill(0, list(range(3, 13))).argmax()[None]
    for _ in range(3):
        logits = dec.decode(nxt)
        nxt = logits.argmax(-1)
    assert logits.dtype == torch.float32 and dec.cap == 64
    assert (dec.keys_read, dec.keys_cached) == (3 * 64, 11 + 12 + 13)
    assert describe(dec)["attention_keys_read_per_cached"] == round(192 / 36, 3)


def test_decode_attention_kernel_benchmark_times_variants_that_agree(tmp_path):
    """``bench_decode_attn.py --kernel``: the engine's attention and SDPA over the query heads compute the same
    output (fp32), every variant is timed, and the JSON on disk is the result; a bad shape is a user error."""
    from draftheads.scripts import bench_decode_attn

    out = tmp_path / "k.json"
    res = bench_decode_attn.main(["--kernel", "--dtype", "fp32", "--rows", "3", "--keys", "17", "--layers", "2",
                                  "--reps", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert set(res["ms_per_step"]) == {"engine_matmuls", "sdpa_enable_gqa", "qk_only", "read_every_kv_once"}
    assert all(v >= 0 for v in res["ms_per_step"].values()) and res["kv_mib"] > 0
    assert res["sdpa_vs_engine_max_abs_diff"] < 1e-5
    with pytest.raises(ValueError, match="--keys must be >= 1, got 0"):
        bench_decode_attn.main(["--kernel", "--keys", "0", "--out", str(tmp_path / "bad.json")])


def test_decode_attention_choice_is_a_fixed_rule_and_checked(tiny_target_dir):
    """``auto`` never depends on a timing (a rerun decodes the same way): fp32 and non-CPU runs keep the matmuls;
    an unknown kernel is a user error naming the allowed ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from draftheads.data_prep.fastgen import SlotDecoder, default_attention, describe

    assert default_attention(torch.device("cpu"), torch.float32) == "matmul"
    assert default_attention(torch.device("cuda"), torch.bfloat16) == "matmul"
    amx = bool(getattr(torch.cpu, "get_capabilities", dict)().get("amx_bf16"))
    assert default_attention(torch.device("cpu"), torch.bfloat16) == ("sdpa" if amx else "matmul")
    m = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    assert describe(SlotDecoder(m, 2, 64))["decode_attention"] == "matmul"
    assert describe(SlotDecoder(m, 2, 64, "sdpa"))["decode_attention"] == "sdpa"
    with pytest.raises(ValueError, match="decode_attention must be auto, matmul or sdpa, got 'flash'"):
        SlotDecoder(m, 2, 64, "flash")


def test_refill_mode_is_checked_before_the_target_loads(tmp_path):
    with pytest.raises(ValueError, match="refill must be merged or separate, got 'both'"):
        distill_main(_cfg(tmp_path / "no-such-model", _chats(tmp_path / "c.jsonl"), tmp_path / "o.jsonl",
                          "refill=both"))


def test_distill_benchmark_ceiling_times_every_linear_layer_and_combines_prefill(tiny_target_dir):
    """``bench_distill.py``'s ceiling: the GEMMs timed are exactly the target's linear layers (every block's q|k|v,
    o, gate|up, down and the lm_head at decode width), and the bound combines decode and prefill rates as
    1 / (1/decode + r/prefill), so it equals the decode rate with no prefill and falls below both with some."""
    import torch
    from transformers import AutoModelForCausalLM

    from draftheads.scripts.bench_distill import linear_ceiling

    m = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    params = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    res = linear_ceiling(m, rows=4, prefill_per_new=0.5, prefill_rows=16, reps=1)
    d, p = res["decode_linear_tokens_per_s"], res["prefill_linear_tokens_per_s"]
    assert d > 0 and p > 0
    assert res["gflop_per_token"] == pytest.approx(2 * params / 1e9, rel=1e-3)
    assert res["new_tokens_per_s_linear_only"] == pytest.approx(1 / (1 / d + 0.5 / p), rel=0.01)
    assert res["new_tokens_per_s_linear_only"] <= min(d, 2 * p)  # strict before rounding to 0.1 tok/s; equal after it when one rate dominates
    alone = linear_ceiling(m, rows=4, prefill_per_new=0.0, prefill_rows=16, reps=1)
    assert alone["new_tokens_per_s_linear_only"] == pytest.approx(alone["decode_linear_tokens_per_s"], rel=0.01)


@pytest.mark.slow
def test_ceiling_for_several_processes_sums_their_linear_rates(tmp_path, tiny_target_dir):
    """``bench_ceiling_procs.py``: every process times the target's linear layers at once; the host's rates are the
    sums and the ceiling follows the same formula as bench_distill's; the JSON on disk is the result."""
    from draftheads.scripts.bench_ceiling_procs import main as ceiling_main

    out = tmp_path / "c.json"
    res = ceiling_main(["--processes", "2", "--threads", "1", "--rows", "4", "--reps", "2", "--r", "0.5",
                        "--target", str(tiny_target_dir), "--dtype", "fp32", "--load-seconds", "8",
                        "--out", str(out)])
    per = res["per_process_decode_tokens_per_s"]
    assert len(per) == 2 and all(x > 0 for x in per) and res["decode_linear_tokens_per_s"] == round(sum(per), 1)
    dec, pre = res["decode_linear_tokens_per_s"], res["prefill_linear_tokens_per_s"]
    assert res["ceiling_new_tokens_per_s"]["0.5"] == pytest.approx(1 / (1 / dec + 0.5 / pre), rel=1e-3)
    assert json.loads(out.read_text()) == res
    with pytest.raises(ValueError, match="--processes must be >= 1, got 0"):
        ceiling_main(["--processes", "0"])


def test_shard_files_merge_into_one_file_and_summary(tmp_path, tiny_target_dir):
    """distill_merge: the shards of a 2-process job concatenated in shard order into ``out`` (what one job
    writes, record for record), one summary adding theirs up; a missing shard is a user error naming it."""
    from draftheads.data_prep.distill_merge import main as merge_main
    from draftheads.data_prep.distill_merge import merge_shards

    data = _chats(tmp_path / "chats.jsonl")
    for i in range(2):
        distill_main(_cfg(tiny_target_dir, data, tmp_path / "d.jsonl", f"shard={i}/2"))
    distill_main(_cfg(tiny_target_dir, data, tmp_path / "one.jsonl"))
    s = merge_shards(tmp_path / "d.jsonl", 2)
    merged = _records(tmp_path / "d.jsonl")
    assert merged == _records(tmp_path / "d.shard0of2.jsonl") + _records(tmp_path / "d.shard1of2.jsonl")
    assert sorted(merged, key=lambda r: r["id"]) == sorted(_records(tmp_path / "one.jsonl"), key=lambda r: r["id"])
    assert s["records"] == s["written"] == len(merged) and s["shards"] == 2
    assert json.loads((tmp_path / "d.jsonl.summary.json").read_text())["new_tokens"] == s["new_tokens"] > 0
    (tmp_path / "d.shard1of2.jsonl").unlink()
    with pytest.raises(ValueError, match="shard files missing: .*d.shard1of2.jsonl"):
        merge_shards(tmp_path / "d.jsonl", 2)
    with pytest.raises(ValueError, match="usage: .*got \\['only-one-arg'\\]"):
        merge_main(["only-one-arg"])


def test_shards_never_replace_what_one_process_distilled(tmp_path, tiny_target_dir):
    """An out file one process wrote is neither sharded over (its conversations would be distilled again) nor
    replaced by a merge (its records would be lost): both are user errors naming the file, and the file is kept."""
    from draftheads.data_prep.distill_merge import merge_shards

    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "one.jsonl"
    distill_main(_cfg(tiny_target_dir, data, out, "num_conversations=6"))
    before = out.read_bytes()
    with pytest.raises(ValueError, match=f"out={out} holds records that one process distilled.*one.shard0of2.jsonl"):
        distill_main(_cfg(tiny_target_dir, data, out, "shard=1/2"))
    assert not (tmp_path / "one.shard1of2.jsonl").exists()
    for i in range(2):  # shard files made elsewhere (say, copied in): the merge still keeps the one-process file
        distill_main(_cfg(tiny_target_dir, data, tmp_path / "two.jsonl", f"shard={i}/2", "num_conversations=4"))
        (tmp_path / f"one.shard{i}of2.jsonl").write_bytes((tmp_path / f"two.shard{i}of2.jsonl").read_bytes())
    with pytest.raises(ValueError, match=f"{out} was not written by a merge of its 2 shards .*says shard 0/1"):
        merge_shards(out, 2)
    assert out.read_bytes() == before
    merge_shards(tmp_path / "two.jsonl", 2)  # a merge's own file is replaced by the next merge
    merge_shards(tmp_path / "two.jsonl", 2)
    assert len(_records(tmp_path / "two.jsonl")) == 4
