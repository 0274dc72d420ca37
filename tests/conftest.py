"""Shared fixtures: tiny tokenizers with real chat templates, tiny random Llama/Qwen2 targets saved
as normal transformers checkpoints, and small synthetic conversation files. No downloads."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # a worker's subprocesses share the cores with the other workers
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("MKL_NUM_THREADS", _share)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("HYDRA_FULL_ERROR", "DRAFTHEADS_DEBUG"):  # a CI that exports one turns one-line user errors into
    os.environ.pop(_var, None)  # tracebacks; tests that want one set it themselves (monkeypatch)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Meta-Llama-3-8B-Instruct's template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Qwen2.5-Instruct's template without the tool-calling branches.
QWEN2 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

WORDS = ("the a one two three four five six seven eight nine ten cat dog red blue green fast slow "
         "hello there how are you fine thanks yes no please count list name city river tree").split()


def make_tokenizer(template: str = CHATML, vocab_size: int = 400):
    """A byte-level BPE fast tokenizer with the special tokens of ChatML and Llama-3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)]
    corpus += ["user assistant system You are a helpful AI assistant named SmolLM, trained by Hugging Face",
               "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."] * 20
    tok.train_from_iterator(corpus, trainer)
    eos = "<|eot_id|>" if template is LLAMA3 else "<|im_end|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   bos_token="<|begin_of_text|>")
    fast.chat_template = template
    return fast


def tiny_config(kind: str = "llama", vocab_size: int = 400, layers: int = 4, hidden: int = 64):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if kind == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(kind)


def tiny_model(kind: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(kind, **kw)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    return model


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """Learnable chats: the assistant counts or repeats a word list — enough structure for heads to learn."""
    rng = random.Random(seed)
    nums = WORDS[2:12]
    out = []
    for i in range(n):
        if i % 2 == 0:
            start = rng.randrange(0, 5)
            ask = f"count from {nums[start]} ({i})"  # distinct prompts: dedupe keeps all n conversations
            ans = " ".join(nums[start:] + nums[:start])
        else:
            ws = [rng.choice(WORDS) for _ in range(6)]
            ask = "please list " + " ".join(ws)
            ans = " ".join(ws + ws)
        out.append({"id": f"conv-{i}", "conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": ans}]})
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target + ChatML tokenizer saved like a normal local checkpoint."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(d)
    make_tokenizer(CHATML).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model("qwen2", seed=1).save_pretrained(d)
    make_tokenizer(QWEN2).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("chats")
    p = d / "chats.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(240)) + "\n")
    return p


def deepest_draft(drafter: dict) -> int:
    """The most drafts one step of an eval result's drafter can accept: its tree's depth, or the prompt-lookup branch
    merged into it (tree.lookup_branch, which tree=auto may choose) where that is longer."""
    return max(int(drafter["tree_depth"]), int(drafter.get("lookup_branch") or 0))


def assert_tau_accounts_for_tokens(tau: float, rows: list[dict], max_depth: int | None = None) -> None:
    """Pin a job's τ to what its turns emitted, instead of ``τ >= 1`` (true of any τ): per turn the first token
    comes from the prefill and each verification step emits its accepted drafts plus one, so the turn's new
    tokens end within its last step (that step may be cut by max_new_tokens or EOS); no step accepts more than
    its tree's depth (``tree_depths`` per step where the row has them, else ``max_depth``); and τ is
    (accepted + steps) / steps over all rows, as rounded in the result."""
    acc = steps = 0
    for r in rows:
        a = list(r["accepted"])
        before_last = 1 + sum(x + 1 for x in a[:-1])
        if a:
            assert before_last < r["new_tokens"] <= before_last + a[-1] + 1, (r["new_tokens"], a)
        else:
            assert r["new_tokens"] == 1, (r["new_tokens"], a)
        depths = r.get("tree_depths") or [max_depth] * len(a)
        assert all(d is None or x <= d for x, d in zip(a, depths)), (a, depths)
        acc, steps = acc + sum(a), steps + len(a)
    assert steps > 0, rows
    assert tau == round((acc + steps) / steps, 4), (tau, acc, steps)


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Every test but the SmolLM2 integration ones runs torch on one thread: their models are tiny, and on a 2-core
    host two threads made each small op wait for the other core (the fast tier took 1.6-2x longer); restored
    afterwards. Integration tests share the cores among the pytest-xdist workers. Subprocesses a test starts keep
    their own thread count."""
    threads = 1
    if request.node.get_closest_marker("integration") is not None:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        threads = max(1, (os.cpu_count() or 1) // workers)
    before = torch.get_num_threads()
    torch.set_num_threads(min(threads, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of many tiny forwards: on a loaded 2-core machine two threads made them
    ~10x slower (each op waits for a busy second core); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def cache_env(tmp_path, monkeypatch) -> Path:
    """Isolate the draftheads cache (prepared data, converted targets) per test."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def compose(config_name: str, overrides: list[str]):
    """Compose a shipped Hydra config the way the entry points do."""
    from hydra import compose as hcompose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return hcompose(config_name=config_name, overrides=overrides)


def tiny_train_overrides(target_dir: Path, data_file: Path, out_dir: Path, **extra) -> list[str]:
    ov = [
        "target=hf", f"target.name={target_dir}", "target.dtype=fp32", "target.local_files_only=true",
        "data=file", f"data.path={data_file}", "data.max_length=64", "data.heldout_fraction=0.1",
        f"data.cache_dir={out_dir / 'data-cache'}",
        f"out_dir={out_dir}", "logging.wandb=disabled", "train.device=cpu", "train.mixed_precision=no",
        "train.batch_size=8", "train.max_steps=6", "train.log_every=1", "train.save_every=0",
        "optim.warmup_steps=0",
    ]
    ov += [f"{k}={v}" for k, v in extra.items()]
    return ov


def run_tree(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for commands that start their own
    children (a recipe script's trainers, ``accelerate launch``'s workers): on a timeout or any other exit the whole
    process group is killed. Why: ``subprocess.run`` kills only the direct child, and a timed-out recipe test left its
    ``eval/measure.py`` running for 20 minutes beside the next job."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:  # timed out or interrupted: the group, not just the shell
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
