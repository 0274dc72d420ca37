"""Baseline drafters that go through the same generation loop as the trained heads.

* :class:`PromptLookupDrafter` — prompt lookup (Saxena, 2023) as deployed: the longest n-gram
  (n from ``max_ngram`` down to ``min_ngram``) ending at the last token is looked up at its most recent
  earlier occurrence in prompt + generated text, and the up to ``num_tokens`` tokens that followed it
  there are proposed as a chain. No model, so draft cost ~0; deterministic, so ``draft_probs`` is None.
  (transformers' built-in ``prompt_lookup_num_tokens`` differs in two details: it matches n ≤ 2 by
  default and takes the *earliest* occurrence; eval/measure.py runs it as an off-the-shelf peer.)
* :class:`DraftModelDrafter` — a small causal LM sharing the target's tokenizer, run autoregressively
  with its own KV cache for ``k`` tokens (greedy, or sampled with ``draft_probs`` under the same
  temperature / top-p / top-k as the target, which exact verification needs). After verification its
  cache is rolled back to the accepted prefix, so it always equals a fresh prefill of the accepted text.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from draftheads.eval.generate import DraftTree, crop_cache
from draftheads.eval.verify import apply_sampling
from draftheads.heads.target import FrozenTarget, TargetConfig, dtype_name, load_target

SELF_PREFIX = "self:"  # draft_model=self:<n>: the target's own first n layers (+ final norm and lm_head)


class ChainShapes:
    """Parents / depths / ancestor masks of chains, built once per length (no per-step Python loops)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents [n], depths [n], mask [n, n]) of a chain of n nodes, root included."""
        if n not in self._cache:
            depths = torch.arange(n)
            self._cache[n] = (depths - 1, depths, torch.ones(n, n, dtype=torch.bool).tril())
        return self._cache[n]


class PromptLookupDrafter:
    """Chain drafts copied from the most recent earlier occurrence of the longest matching n-gram."""

    layers: tuple[int, ...] = ()

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1:
            raise ValueError(f"prompt lookup num_tokens must be >= 1, got {num_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = int(num_tokens), int(max_ngram), int(min_ngram)
        self.seq: list[int] = []
        # index[n][gram] = start of the most recent occurrence of `gram` that is followed by at least one token.
        # Updated as tokens arrive, so a lookup is O(max_ngram) dict probes instead of a scan of the text.
        self.index: list[dict[tuple[int, ...], int]] = []
        self._chains = ChainShapes()

    def begin(self, prompt_ids: torch.Tensor, hidden: Mapping[int, torch.Tensor]) -> None:
        self.seq = []
        self.index = [{} for _ in range(self.max_ngram + 1)]
        self.extend(torch.as_tensor(prompt_ids).view(-1).tolist())

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the known text and index the n-grams they complete a continuation for."""
        seq, index = self.seq, self.index
        for t in tokens:
            i = len(seq)  # position of t; the n-grams ending at i-1 are followed by t
            seq.append(int(t))
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                index[n][tuple(seq[i - n:i])] = i - n

    def lookup(self) -> list[int]:
        """Continuation (≤ num_tokens) after the most recent earlier match of the longest suffix n-gram."""
        seq, L = self.seq, len(self.seq)
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            j = self.index[n].get(tuple(seq[L - n:]))
            if j is not None:  # j + n < L by construction: at least one token follows the match
                return seq[j + n:min(j + n + self.num_tokens, L)]
        return []

    def propose(self, root: int, sampling: Any, generator: Any) -> DraftTree:
        self.extend([root])
        cont = self.lookup()
        parents, depths, mask = self._chains(len(cont) + 1)
        return DraftTree(torch.tensor([root] + cont), parents, None, depths, mask)

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: Any) -> None:
        # the root is already in seq; next_token arrives as the next root
        self.extend(tree.tokens[list(path[1:])].tolist())


class DraftModelDrafter:
    """A small causal LM drafting a chain of ``k`` tokens with its own KV cache (rolled back after each step).

    Cache invariant: ``self.cache`` holds the draft's keys/values for ``seq[:n_cached]`` of the accepted
    text; ``self.pending`` are accepted tokens not yet fed (the root is fed by ``propose``).
    """

    layers: tuple[int, ...] = ()

    def __init__(self, model: nn.Module, k: int = 4, vocab_size: int | None = None):
        if k < 1:
            raise ValueError(f"draft model k (tokens per step) must be >= 1, got {k}")
        self.model = model.eval().requires_grad_(False)
        self.k = int(k)
        self.vocab_size = int(vocab_size or model.get_output_embeddings().weight.shape[0])  # the target's vocab
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self._chains = ChainShapes()
        self.cache: Any = None
        self.n_cached = 0
        self.pending: list[int] = []
        self._root_pos = 0

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def new_cache(self) -> Any:
        """Every position on every layer (as FrozenTarget.new_cache): ``accept`` crops it back to the accepted
        drafts, which a sliding-window layer that has dropped its oldest positions cannot be."""
        from transformers import DynamicCache

        return DynamicCache()

    @torch.no_grad()
    def _feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` on top of the cache; return the draft's logits after the last one, as [V_target] float."""
        n = len(ids)
        x = torch.tensor([list(ids)], device=self.device)  # [1, n]
        pos = torch.arange(self.n_cached, self.n_cached + n, device=self.device)[None]  # [1, n]
        kw = {self._cache_kw: self.cache, "use_cache": True, "position_ids": pos}
        if self._keep_kw:
            kw[self._keep_kw] = 1
        logits = self.model(input_ids=x, **kw).logits[0, -1].float()  # [V_draft]
        self.n_cached += n
        V = self.vocab_size
        if logits.shape[0] > V:  # padded draft vocab: rows past the target's vocab are never real tokens
            logits = logits[:V]
        elif logits.shape[0] < V:
            logits = torch.cat([logits, logits.new_full((V - logits.shape[0],), float("-inf"))])
        return logits

    def begin(self, prompt_ids: torch.Tensor, hidden: Any) -> None:
        self.cache = self.new_cache()
        self.n_cached = 0
        ids = torch.as_tensor(prompt_ids).view(-1).tolist()
        if ids:
            self._feed(ids)  # draft prefill here, so per-step draft time is decoding only
        self.pending = []

    @torch.no_grad()
    def propose(self, root: int, sampling: Mapping[str, Any] | None, generator: torch.Generator | None) -> DraftTree:
        """k draft tokens: greedy (``sampling`` None) or sampled with their distributions in draft_probs."""
        self._root_pos = self.n_cached + len(self.pending)
        feed = self.pending + [int(root)]
        tokens, rows = [int(root)], []
        for _ in range(self.k):
            logits = self._feed(feed)  # [V]
            if sampling is None:
                t = int(logits.argmax())
            else:
                q = apply_sampling(logits, float(sampling.get("temperature", 1.0)), float(sampling.get("top_p", 1.0)),
                                   int(sampling.get("top_k", 0)))  # [V]
                qs = q if generator is None or generator.device == q.device else q.to(generator.device)
                t = int(torch.multinomial(qs, 1, generator=generator))
                rows.append(q)
            tokens.append(t)
            feed = [t]
        self.pending = []
        parents, depths, mask = self._chains(self.k + 1)
        probs = None
        if rows:  # row i = the distribution node i was drawn from; row 0 (root) unused
            probs = torch.cat([torch.zeros_like(rows[0])[None], torch.stack(rows)]).cpu()  # [k+1, V]
        return DraftTree(torch.tensor(tokens), parents, probs, depths, mask)

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: Any) -> None:
        """Keep the cache for root + accepted drafts; the last draft token was never fed, so queue it if accepted."""
        m = len(path) - 1  # accepted drafts d_1..d_m (a chain: path = [0, 1, ..., m])
        fed = min(m, self.k - 1)  # d_1..d_{k-1} were fed while drafting
        crop_cache(self.cache, self._root_pos + 1 + fed)
        self.n_cached = self._root_pos + 1 + fed
        self.pending = [int(tree.tokens[m])] if m > fed else []


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def truncated_target(target: FrozenTarget, n_layers: int) -> nn.Module:
    """A draft model made of the target's first ``n_layers`` decoder layers + its final norm and lm_head.

    Why: a small LM that shares the tokenizer by construction (early exit, as in LayerSkip / "self-
    speculative" decoding), for targets with no smaller sibling. Untrained for early exit, so its
    acceptance is modest; it exists to exercise the draft-model baseline on any target.
    """
    import copy

    from transformers import AutoModelForCausalLM

    L = target.num_layers
    if not 1 <= n_layers < L:
        raise ValueError(f"draft_model=self:{n_layers}: need 1 <= n < {L} (the target's layer count)")
    cfg = copy.deepcopy(target.model.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    model = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    # assign=True shares the target's tensors (no copy); the draft keeps its own KV cache
    missing, _ = model.load_state_dict(target.model.state_dict(), strict=False, assign=True)
    if missing:
        raise ValueError(f"truncated target draft: weights missing for {missing[:3]}")
    return model.to(target.device).eval()


def load_draft_model(spec: str, target: FrozenTarget, dtype: torch.dtype, local_files_only: bool = True
                     ) -> nn.Module:
    """Load the draft LM named by ``spec`` (local dir, hub id, embedded name, or ``self:<n>``)."""
    if not spec:
        raise ValueError("drafter=draft_model needs draft_model=<dir | hub id | embedded name | self:<n layers>>")
    if spec.startswith(SELF_PREFIX):
        try:
            n = int(spec[len(SELF_PREFIX):])
        except ValueError:
            raise ValueError(f"draft_model={spec!r}: expected self:<number of layers>") from None
        return truncated_target(target, n)
    draft = load_target(TargetConfig(name=spec, dtype=dtype_name(dtype), local_files_only=local_files_only), target.device)
    check_same_tokenizer(draft.tokenizer, target.tokenizer, spec)
    return draft.model


def check_same_tokenizer(draft_tok: Any, target_tok: Any, what: str) -> None:
    """Refuse a draft model whose vocabulary maps tokens differently: its ids would be meaningless to the target."""
    if draft_tok is None or target_tok is None:
        return
    a, b = draft_tok.get_vocab(), target_tok.get_vocab()
    if a != b:
        diff = next((t for t in b if a.get(t) != b[t]), None)
        raise ValueError(f"draft model {what!r} does not share the target's tokenizer (vocab sizes {len(a)} vs "
                         f"{len(b)}; first differing token {diff!r})")


def prompt_lookup_from(options: Mapping[str, Any]) -> PromptLookupDrafter:
    """Prompt lookup from baselines options (lookup_tokens, lookup_max_ngram, lookup_min_ngram); also the lookup
    branch of a head's tree (eval/lookup_branch.py)."""
    return PromptLookupDrafter(int(options.get("lookup_tokens", 10)), int(options.get("lookup_max_ngram", 3)),
                               int(options.get("lookup_min_ngram", 1)))


def build_prompt_lookup(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                        options: Mapping[str, Any] | None = None, num_heads: int = 0,
                        shared: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The prompt-lookup drafter from eval options (see conf/baselines/default.yaml)."""
    d = prompt_lookup_from(dict(options or {}))
    return d, {"drafter": "prompt_lookup", "tree_size": d.num_tokens + 1, "tree_depth": d.num_tokens,
               "max_ngram": d.max_ngram, "min_ngram": d.min_ngram}


def build_draft_model(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                      options: Mapping[str, Any] | None = None, num_heads: int = 0,
                      shared: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """A small LM (``baselines.draft_model``) drafting ``baselines.draft_tokens``; loaded once per ``shared``."""
    o = dict(options or {})
    spec, k = o.get("draft_model"), int(o.get("draft_tokens", 4))
    key = ("draft_model", str(spec))
    if shared is not None and key in shared:
        model = shared[key]
    else:
        model = load_draft_model(spec, target, dtype, bool(o.get("local_files_only", True)))
        if shared is not None:
            shared[key] = model
    n_params = sum(p.numel() for p in model.parameters())
    return DraftModelDrafter(model, k, target.vocab_size), {
        "drafter": "draft_model", "draft_model": spec, "draft_params": n_params, "tree_size": k + 1, "tree_depth": k}
