"""Train a block draft (DFlash-style) on a frozen target: ``accelerate launch train/block.py [overrides]``.

Per row, ``head.anchors`` random anchor positions a are drawn among the positions whose next token is an
assistant token, from a generator keyed by (``train.seed``, step, the row's tokens): the same row at the same step
gets the same anchors under any launch topology, batch padding or resume. Each anchor's block is
[x_a, mask, ..., mask] at positions a .. a+n-1 (n = ``head.block_size``); it attends to the context entries of
the same document before a (the target's hidden states at 0..a-1, exactly what decoding has when x_a is the root)
and bidirectionally within itself. Block entry j >= 1 is trained with
cross-entropy on x_{a+j} (the data's token: in the recipe, the target's own continuation), weighted decay^(j-1)
so the early positions, which every accepted chain needs, count most. Context entries run once per row, causal
per document, and are shared by all its blocks.

With ``head.draft_vocab_size`` the draft's logits cover its own vocabulary (heads/block.py); a label outside it
is left out of the CE (no row can score it) and counts as a miss in top-1.

Held-out metrics (CE, top-1 per block position) and the simulated τ (the greedy chain of the whole block at every
held-out position on the target's greedy path) are logged at every ``train.eval_every`` and at the end.

Reads top to bottom: setup (devices, target, data, draft, features), loop (shared Trainer), save.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from draftheads.data_prep.dataset import prepare_data, shifted_valid
from draftheads.data_prep.draft_vocab import counted_vocab
from draftheads.data_prep.features import batch_hidden
from draftheads.heads import job
from draftheads.heads.block import BlockConfig, BlockDraft, block_config_for
from draftheads.heads.checkpoint import read_head_config
from draftheads.heads.eagle3_vocab import draft_ids_of
from draftheads.heads.target import FrozenTarget, load_target
from draftheads.train.common import aux_scale_mode, feature_source, fix_aux_scale, heldout_evaluator
from draftheads.train.losses import chunked_sum, chunked_topk, linear_cross_entropy
from draftheads.train.loop import (Trainer, build_tau_evaluator, greedy_windows, list_checkpoints, lockstep_batches,
                                   make_accelerator, reference_ranks, resolve_out_dir, save_run_config, write_summary)

log = logging.getLogger(__name__)
HELDOUT_NAMES = {"ce": "heldout_ce", "top1/j1": "heldout_top1"}
EVAL_SEED = 1234  # keys the held-out rows' anchors: the same draw at every evaluation, whatever training did


def _doc_and_pos(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position document ids and position ids [B, T] (one document per row when the batch is not packed)."""
    ids = batch["input_ids"]
    B, T = ids.shape
    if "doc_ids" in batch:
        return batch["doc_ids"], batch["position_ids"]
    ar = torch.arange(T, device=ids.device)[None].expand(B, T)
    return torch.zeros_like(ids), ar


class BlockObjective(nn.Module):
    """Σ_j decay^(j-1) · CE(block entry j, x_{a+j}) over random anchors a (see the module doc)."""

    def __init__(self, draft: BlockDraft, target: FrozenTarget, anchors: int = 32, decay: float = 0.8,
                 seed: int = 0):
        super().__init__()
        if anchors < 1:
            raise ValueError(f"head.anchors must be >= 1, got {anchors}")
        if not 0 < decay <= 1:
            raise ValueError(f"head.decay must be in (0, 1], got {decay}")
        self.draft = draft
        object.__setattr__(self, "target", target)  # unregistered: never optimized, wrapped or saved
        self.anchors, self.decay, self.seed = int(anchors), float(decay), int(seed)
        self._step = 0  # the optimizer step, set by the loop (begin_step): training anchors depend on it
        self.n = draft.config.block_size
        self.layers = list(draft.config.context_layers)  # what the features source must provide

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss's weight sum: anchors drawn per row (``head.anchors`` or fewer) times Σ_j decay^(j-1), so the
        logged loss is about the weighted mean CE per drafted position (labels past a document's end are fewer)."""
        per_row = shifted_valid(batch, 1).sum(1).clamp(max=self.anchors)
        return per_row.sum() * sum(self.decay ** (j - 1) for j in range(1, self.n))

    def begin_step(self, step: int) -> None:
        """Called by the shared loop before each optimizer step."""
        self._step = int(step)

    def _row_scores(self, batch: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        """[B, width] uniform scores for the positions that hold a token (-1 elsewhere), each row's from a generator
        keyed by (seed, step, its tokens); held-out rows use a fixed key, so evaluation never moves with training."""
        ids, real = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
        key = repr((self.seed, self._step) if self.training else (EVAL_SEED, "heldout")).encode()
        score = torch.full((ids.shape[0], width), -1.0)
        for b in range(ids.shape[0]):
            at = real[b].nonzero()[:, 0]  # the row's token positions, wherever the padding is
            g = torch.Generator().manual_seed(zlib.crc32(ids[b, at].numpy().tobytes(), zlib.crc32(key)))
            r = torch.rand(at.numel(), generator=g)  # one draw per token: the same for any padded width
            inside = at < width
            score[b, at[inside]] = r[inside]
        return score

    def _anchors(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [B, m], valid [B, m]): up to ``head.anchors`` distinct random positions per row whose next
        token is a label."""
        ok = shifted_valid(batch, 1)  # [B, T-1]
        score = self._row_scores(batch, ok.shape[1]).to(ok.device)
        score = torch.where(ok, score, torch.full_like(score, -1.0))
        m = min(self.anchors, ok.shape[1])
        top, idx = score.topk(m, dim=1)  # [B, m]
        return idx, top >= 0

    def blocks(self, batch: dict[str, torch.Tensor], hidden: dict[int, torch.Tensor], anchors: torch.Tensor,
               ) -> torch.Tensor:
        """Draft outputs [B, m, n, H] of the blocks rooted at ``anchors`` [B, m], all in one forward."""
        ids = batch["input_ids"]
        B, T = ids.shape
        m, n = anchors.shape[1], self.n
        dev = ids.device
        doc, pos = _doc_and_pos(batch)
        ctx = self.draft.context(torch.cat([hidden[layer] for layer in self.layers], dim=-1))  # [B, T, H]
        root = ids.gather(1, anchors)  # [B, m]
        blk_ids = root[:, :, None].expand(B, m, n).reshape(B, m * n)
        is_mask = (torch.arange(n, device=dev) > 0)[None, None].expand(B, m, n).reshape(B, m * n)
        blk = self.draft.block(blk_ids, is_mask)  # [B, m·n, H]
        blk_pos = (pos.gather(1, anchors)[:, :, None] + torch.arange(n, device=dev)).reshape(B, m * n)
        a_doc = doc.gather(1, anchors)  # [B, m]
        before = (torch.arange(T, device=dev)[None, None] < anchors[:, :, None]) & (doc[:, None] == a_doc[:, :, None])
        own = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool, device=dev)] * m)  # [m·n, m·n]
        blk_allowed = torch.cat([before[:, :, None].expand(B, m, n, T).reshape(B, m * n, T),
                                 own[None].expand(B, m * n, m * n)], dim=2)  # [B, m·n, T + m·n]
        return self.draft.rows(ctx, pos, doc, blk, blk_pos, blk_allowed).reshape(B, m, n, -1)  # [B, m, n, H]

    def _labels(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [B, m, n-1] = x_{a+j} for j = 1..n-1, ok [B, m, n-1]: a valid anchor whose x_{a+j} is a label of
        a's document)."""
        ids = batch["input_ids"]
        B, T = ids.shape
        doc, _ = _doc_and_pos(batch)
        at = anchors[:, :, None] + torch.arange(1, self.n, device=ids.device)  # [B, m, n-1]
        inside = at < T
        at = at.clamp(max=T - 1).reshape(B, -1)
        lm = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        same = doc.gather(1, at) == doc.gather(1, anchors).repeat_interleave(self.n - 1, dim=1)
        ok = valid[:, :, None] & inside & (lm.gather(1, at) & same).view(B, -1, self.n - 1)
        return ids.gather(1, at).view(B, -1, self.n - 1), ok

    def forward(self, batch: dict[str, torch.Tensor]):
        hidden = batch_hidden(batch, self.target, self.layers)
        anchors, valid = self._anchors(batch)
        h = self.blocks(batch, hidden, anchors)  # [B, m, n, H]
        labels, ok = self._labels(batch, anchors, valid)  # [B, m, n-1]
        column = self._columns()
        loss = torch.zeros((), device=h.device)
        stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        total_ce, total_n = torch.zeros((), device=h.device), torch.zeros((), device=h.device)
        for j in range(1, self.n):  # every position runs, even without labels: ZeRO-3/FSDP forwards are collective
            okj = ok[..., j - 1]
            r = okj.sum().float()  # top-1's denominator: a label outside the draft vocabulary is a miss
            rows, y = self._scored(h[:, :, j][okj], labels[..., j - 1][okj], column)  # [r', H], [r'] draft ids
            fused = linear_cross_entropy(rows, self.draft.frozen_lm_head(), y, 1)
            ce, hits = fused if fused is not None else chunked_sum(self._chunk_ce, rows, y,
                                                                   vocab=self.draft.out_vocab)
            assert hits is not None
            loss = loss + self.decay ** (j - 1) * ce
            stats[f"ce/j{j}"] = (ce.detach(), r.new_tensor(float(y.numel())))
            stats[f"top1/j{j}"] = (hits[0], r)
            total_ce, total_n = total_ce + ce.detach(), total_n + y.numel()
        stats["ce"] = (total_ce, total_n)
        return loss, stats

    def _columns(self) -> torch.Tensor | None:
        """[V] target id -> draft id (-1 outside) with a draft vocabulary, else None."""
        return draft_ids_of(self.draft.t2d) if self.draft.config.draft_vocab_size else None

    def _scored(self, rows: torch.Tensor, y: torch.Tensor, column: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r, H] and target-id labels [r] -> those the draft's logits can score, labels as logit columns."""
        if column is None:
            return rows, y
        inside = self.draft.t2d[y]  # [r]
        return rows[inside], column[y[inside]]

    def _chunk_ce(self, rows: torch.Tensor, y: torch.Tensor, stats: bool = True):
        z = self.draft.logits(rows).float()  # [r, V]
        ce = torch.nn.functional.cross_entropy(z, y, reduction="sum")
        return ce, ((z.argmax(-1) == y).sum().float().view(1) if stats else None)

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], top_k: int = 10) -> tuple[torch.Tensor, int]:
        """Ranks [n, D] (D = block_size - 1) of the greedy reference among each block position's top-k, for the
        loop's simulated τ: at every held-out position t on the target's greedy path (``greedy_windows``), the
        block rooted at x_{t+1} after the context f_<=t — what one decoding step drafts there."""
        ids = batch["input_ids"]
        B, T = ids.shape
        D, L = self.n - 1, self.target.num_layers
        hidden = batch_hidden(batch, self.target, sorted(set(self.layers) | {L}))
        win, considered = greedy_windows(batch, hidden[L], self.target.lm_head(), D + 1)  # [B, T-D-1]
        ranks = []
        for b in range(B):
            roots = win[b].nonzero()[:, 0] + 1  # anchors a = t + 1
            for i in range(0, roots.numel(), 64):  # bounded blocks per forward
                a = roots[i:i + 64]
                row = {k: v[b:b + 1] for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2}
                h = self.blocks(row, {k: v[b:b + 1] for k, v in hidden.items()}, a[None])[0]  # [m, n, H]
                per = [reference_ranks(self.draft.to_target(chunked_topk(h[:, j], self.draft.logits, top_k,
                                                                         self.draft.out_vocab)),
                                       ids[b, a + j], top_k) for j in range(1, D + 1)]
                ranks.append(torch.stack(per, dim=1))
        out = torch.cat(ranks) if ranks else torch.zeros(0, D, dtype=torch.long, device=ids.device)
        return out, considered

    def save_pretrained(self, path, extra: dict[str, Any]) -> None:
        self.draft.save_pretrained(path, self.target.identity, extra)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.draft.load_state_dict(state)


@torch.no_grad()
def greedy_rank_accuracy(objective: BlockObjective, heldout: Any, batch_fn: Any, acc: Any, n_rows: int,
                         top_k: int = 10) -> tuple[list[list[float]], int]:
    """[D][top_k]: per block position, the share of held-out greedy-path positions whose next token is the draft's
    rank-r candidate there (``acceptance_ranks``), over the first ``n_rows`` held-out rows, summed over processes.
    Recorded in the checkpoint as ``rank_accuracy``, it tunes the block's static tree as Medusa's held-out hits
    tune Medusa's (eval/drafters.py:ranked_static_tree); measured on the greedy path, the positions decoding drafts at."""
    hits = torch.zeros(objective.n - 1, top_k + 1, dtype=torch.float64)
    was = objective.training
    objective.train(False)
    with acc.autocast():
        for idx, counted in lockstep_batches(n_rows, 4, acc):
            b = {k: v.to(acc.device) for k, v in batch_fn([heldout[i] for i in idx]).items()}
            ranks, _ = objective.acceptance_ranks(b, top_k)  # [n, D], top_k where the reference is no candidate
            if counted:
                hits += nn.functional.one_hot(ranks.cpu(), top_k + 1).sum(0).double()
    objective.train(was)
    if acc.num_processes > 1:
        hits = acc.reduce(hits.to(acc.device), "sum").cpu()
    n = int(hits[0].sum())
    return (hits[:, :top_k] / max(n, 1)).tolist(), n


def draft_from(path: Path, target: FrozenTarget, h: DictConfig, want: BlockConfig
               ) -> tuple[BlockDraft, dict[str, Any] | None, bool]:
    """``head.init_from``: a trained block draft to fine-tune (e.g. on more data). Its architecture is kept; the head
    settings given must agree with it (null ones take the checkpoint's), so a run never trains something other than
    what its config says. One change is allowed: a whole-vocabulary draft given ``head.draft_vocab_size`` keeps every
    trained weight (its output rows are the target's frozen lm_head either way) and gets a draft vocabulary counted on
    the training split, as a fresh run would. Returns (draft, its vocabulary info, whether the caller must count the
    draft vocabulary)."""
    src = BlockDraft.from_pretrained(path, target)
    c = src.config
    narrow = not c.draft_vocab_size and bool(want.draft_vocab_size)
    for key in ("context", "num_layers", "block_size", "context_layers", "mask_token_id", "draft_vocab_size"):
        if h.get(key) is not None and getattr(c, key) != getattr(want, key) and not (narrow and
                                                                                  key == "draft_vocab_size"):
            raise ValueError(f"head.init_from={path}: the checkpoint has {key}={getattr(c, key)!r} but head.{key} "
                             f"asks for {getattr(want, key)!r}; set head.{key}={getattr(c, key)!r} (or null), or "
                             f"start a fresh run without head.init_from")
    if narrow:
        draft = BlockDraft(replace(c, draft_vocab_size=want.draft_vocab_size), target)
        missing, unexpected = draft.load_state_dict(src.state_dict(), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight", "d2t", "t2d"}, (missing, unexpected)
        return draft, None, True
    if not c.draft_vocab_size:
        return src, None, False
    saved = read_head_config(path).get("draft_vocab") or {}
    return src, {**{k: v for k, v in saved.items() if k != "source"}, "source": f"init_from:{path}"}, False


def build(cfg: DictConfig) -> dict[str, Any]:
    """Everything main() needs, exposed so tests can stop and resume the Trainer."""
    acc = make_accelerator(cfg)
    out_dir = resolve_out_dir(cfg)
    target = load_target(cfg.target, device=acc.device)
    with acc.main_process_first():
        data = prepare_data(cfg.data, target.tokenizer)
    h = cfg.head
    layers = None if h.context_layers is None else [int(x) for x in h.context_layers]
    mask_id = h.get("mask_token_id")
    dv = h.get("draft_vocab_size")
    dv = 0 if dv is None else job.config_int(h, "draft_vocab_size", 0, 1, "head")
    if dv > target.vocab_size:
        raise ValueError(f"head.draft_vocab_size={dv} is larger than the target's vocabulary ({target.vocab_size}); "
                         f"use at most {target.vocab_size}, or null for the whole vocabulary")
    head_cfg = block_config_for(target, layers, job.config_int(h, "num_layers", 2, 1, "head"),
                                job.config_int(h, "block_size", 8, 2, "head"), str(h.get("context") or "prefix"),
                                None if mask_id is None else int(mask_id), dv,
                                aux_scale_mode(h.get("aux_scale")) is not False)
    vocab_info = None
    if h.get("init_from"):  # a fine-tune: architecture and vocabulary come from the checkpoint (resume loads on top)
        draft, vocab_info, recount = draft_from(Path(h.init_from), target, h, head_cfg)
        head_cfg = draft.config
        dv = head_cfg.draft_vocab_size if recount else 0  # 0: kept from the checkpoint, or none
    else:
        torch.manual_seed(int(cfg.train.seed))  # the draft's init depends on the seed only
        draft = BlockDraft(head_cfg, target)
    if dv:  # counted on the training split (deterministic, so a resumed run counts the same vocabulary)
        vocab, vocab_info = counted_vocab(data, target.tokenizer, target.vocab_size, dv,
                                          h.get("draft_vocab_reference"))
        draft.set_vocab(vocab)
    draft = draft.to(acc.device)
    objective = BlockObjective(draft, target, job.config_int(h, "anchors", 32, 1, "head"), float(h.decay),
                               int(cfg.train.seed))
    feats = feature_source(cfg, target, data, objective.layers)
    resuming = bool(cfg.train.resume) and bool(list_checkpoints(out_dir))  # the checkpoint's scale loads on top
    scale_info = fix_aux_scale(draft, feats, target, head_cfg.context_layers, acc,
                               not (h.get("init_from") or resuming), aux_scale_mode(h.get("aux_scale")))
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, out_dir)
        log.info("block draft (context=%s): %d x %s, block %d, context layers %s, %.2fM trainable params; "
                 "%d training examples; features %s; feature scale %s", head_cfg.context, head_cfg.num_layers,
                 type(draft.layers[0]).__name__, head_cfg.block_size, head_cfg.context_layers,
                 sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6, len(data.train), feats.source,
                 json.dumps(scale_info))
        if vocab_info:
            log.info("draft vocabulary: %s", vocab_info)
    extra = {"data": {"name": cfg.data.name, "key": data.stats.get("key"), "rows": data.stats.get("rows")},
             "features": feats.source, **scale_info, **({"draft_vocab": vocab_info} if vocab_info else {}),
             **({"init_from": str(h.init_from)} if h.get("init_from") else {})}
    heldout_stats = heldout_evaluator(objective, data.heldout, feats.heldout_collate, acc,
                                      int(cfg.train.eval_tokens), extra, HELDOUT_NAMES)
    n_rank_rows = min(len(data.heldout), int(cfg.train.get("sim_tau_examples", 0) or 0))

    def evaluate(step: int) -> dict[str, Any]:
        """Held-out CE/top-1, and the per-position rank hit rates the next checkpoint records for eval's tree."""
        out = heldout_stats(step)
        if n_rank_rows:
            rank_acc, n = greedy_rank_accuracy(objective, data.heldout, feats.heldout_collate, acc, n_rank_rows)
            if n:
                extra["rank_accuracy"] = [[round(a, 5) for a in row] for row in rank_acc]
                extra["rank_accuracy_tokens"] = n
        return out

    trainer = Trainer(cfg, acc, objective, feats.train, feats.collate, out_dir, extra, evaluate=evaluate,
                      heldout=data.heldout, heldout_collate=feats.heldout_collate,
                      tau_eval=build_tau_evaluator(cfg, target, data))
    return {"trainer": trainer, "objective": objective, "acc": acc, "out_dir": out_dir, "source": feats.source}


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    b = build(cfg)
    # ---- loop
    result = b["trainer"].fit()
    # ---- save
    return write_summary(b["acc"], b["out_dir"], "block", result, features=b["source"])


@job.main(config_name="block")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
