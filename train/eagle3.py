"""Train an EAGLE-3 draft on a frozen target: ``accelerate launch train/eagle3.py [overrides]``.

Training-time test: every batch unrolls ``head.ttt_steps`` (k) passes of the draft. Step 0 at draft
position t reads fc(aux features at t) with token x_{t+1}; step s reads the draft's own step s-1
output at t with the teacher-forced token x_{t+1+s} at position id t+s, and predicts x_{t+2+s}.
Attention of step s: causal over step 0's keys, plus the same-position key of every step 1..s
(heads.eagle3.ttt_attention, without a dense (k·T)² mask).

Loss: Σ_s decay^s · soft-CE(draft, p̃_target) summed over the valid positions of step s
(``shifted_valid(batch, 2+s)``: x_{t+2+s} is an assistant token of the same document) and divided
by the number of valid step-0 positions in the global batch (the loop's normalizer). p̃_target is the
target's next-token distribution restricted to the draft vocabulary and renormalized (a softmax over
the target's logits at the draft-vocab ids). Out-of-draft-vocab targets: their probability mass is
dropped by the renormalization (the draft cannot propose those tokens anyway); positions are kept
even when little mass remains. ``vocab_mass`` (mean in-vocab mass) and ``oov_argmax`` (share of
positions whose target argmax is outside the draft vocab) are logged, and top-1 accuracy per step
compares the draft's argmax with the target's argmax over the *full* vocabulary, so an
out-of-vocab target token is a miss.

Draft vocabulary: the ``draft_vocab_size`` most frequent assistant-token ids of the training split
(data_prep.draft_vocab; with ``head.draft_vocab_reference``, ranked together with a larger corpus's) for a
fresh draft; taken from the checkpoint — never recounted — when resuming (``train.resume``) or fine-tuning
(``head.init_from``).

Reads top to bottom: setup, loop (shared Trainer), save. ``main(cfg)`` is a plain function.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from draftheads.data_prep.dataset import prepare_data, shifted_valid
from draftheads.data_prep.draft_vocab import counted_vocab
from draftheads.data_prep.features import batch_hidden
from draftheads.heads import job
from draftheads.heads.checkpoint import read_head_config
from draftheads.heads.eagle3 import Eagle3Draft, eagle3_config_for, resolve_draft_vocab_size
from draftheads.heads.eagle3_vocab import draft_ids_of
from draftheads.heads.target import FrozenTarget, load_target
from draftheads.train.common import (aux_scale_mode, draft_sequence, feature_source, fix_aux_scale,
                                    heldout_evaluator)
from draftheads.train.losses import SoftCrossEntropy, chunk_rows, chunked_sum, chunked_topk
from draftheads.train.loop import (Trainer, build_tau_evaluator, greedy_windows, list_checkpoints, make_accelerator,
                        reference_ranks, resolve_out_dir, save_run_config, write_summary)

log = logging.getLogger(__name__)



class Eagle3Objective(nn.Module):
    """Σ_s decay^s · soft-CE over k training-time-test steps (see the module doc for alignment and masking)."""

    def __init__(self, draft: Eagle3Draft, target: FrozenTarget, ttt_steps: int = 7, decay: float = 0.8,
                 loss_checkpoint: bool = True):
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"head.ttt_steps must be >= 1, got {ttt_steps}")
        if not 0 < decay <= 1:
            raise ValueError(f"head.ttt_decay must be in (0, 1], got {decay}")
        self.draft = draft
        object.__setattr__(self, "target", target)  # unregistered: never optimized, wrapped or saved
        self.steps, self.decay, self.loss_checkpoint = int(ttt_steps), float(decay), bool(loss_checkpoint)
        self.aux = list(draft.config.aux_layers)
        self.top = target.num_layers  # layer L: the target's logits are lm_head(f^L)
        self.layers = sorted(set(self.aux) | {self.top})  # what the features source must provide

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_valid(batch, 2).sum()

    @staticmethod
    def draft_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step-0 positions [B, T-1] and causal (per-document) mask [B, T-1, T-1] of the draft's sequence."""
        return draft_sequence(batch)

    @torch.no_grad()
    def target_info(self, top: torch.Tensor) -> dict[str, torch.Tensor]:
        """From the target's final-normed states [B, T, H]: its distribution restricted to the draft vocabulary and
        renormalized [B, T, DV] (target dtype), its full-vocab argmax as a draft id (-1 when outside the draft
        vocab) [B, T], and its probability mass inside the draft vocab [B, T]. The [rows, V] logits exist one row
        chunk at a time (train.losses.chunk_rows), so their size does not grow with the vocabulary."""
        B, T, H = top.shape
        head = self.target.lm_head()
        ids = self.draft.target_ids().to(head.weight.device)  # [DV] sorted target ids: draft id i = column ids[i]
        rows = top.reshape(B * T, H).to(head.weight.dtype)
        probs = torch.empty(B * T, ids.numel(), dtype=top.dtype, device=top.device)
        amax = torch.empty(B * T, dtype=torch.long, device=top.device)
        mass = torch.empty(B * T, dtype=torch.float32, device=top.device)
        c = chunk_rows(head.weight.shape[0])
        with torch.autocast(top.device.type, enabled=False):  # the target's dtype: no per-chunk weight cast
            for i in range(0, B * T, c):
                z = F.linear(rows[i:i + c], head.weight, head.bias).float()  # [c, V]
                r = z.index_select(1, ids)  # [c, DV] logits at the draft-vocab ids
                m_in, a_in = r.max(-1)
                lse_in = torch.logsumexp(r, -1)
                probs[i:i + c] = torch.softmax(r, -1)
                amax[i:i + c] = torch.where(m_in >= z.max(-1).values, a_in, -1)  # a tie with an OOV id: in-vocab wins
                mass[i:i + c] = torch.exp(lse_in - torch.logsumexp(z, -1))
        return {"probs": probs.view(B, T, -1), "argmax": amax.view(B, T), "mass": mass.view(B, T)}

    def _chunk_ce(self, probs: torch.Tensor, argmax: torch.Tensor, h: torch.Tensor, rows: torch.Tensor,
                  stats: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Σ soft-CE of a row chunk (h [c, H] draft outputs, rows [c] their rows of the target's draft-vocab
        distribution probs [B·T, DV]); with ``stats`` also the count of draft argmax = target argmax ([1])."""
        ce, pred = SoftCrossEntropy.apply(self.draft.logits(h), probs[rows])
        if not stats:
            return ce, None
        return ce, (pred == argmax[rows]).sum().float().view(1)  # an OOV target argmax (-1) never hits

    def forward(self, batch: dict[str, torch.Tensor]):
        ids = batch["input_ids"]
        B, T = ids.shape
        S, k = T - 1, self.steps
        hidden = batch_hidden(batch, self.target, self.layers)
        aux = torch.cat([hidden[a][:, :S] for a in self.aux], dim=-1)  # [B, S, n_aux·H] features at t
        tokens = torch.cat([ids[:, 1:], ids.new_zeros(B, k - 1)], dim=1)  # [B, S+k-1]; step s reads x_{t+1+s}
        pos, step0 = self.draft_inputs(batch)
        outs = self.draft.rollout(aux, tokens, pos, step0, k)  # k × [B, S, H]
        tgt = self.target_info(hidden[self.top])
        # every step reads its rows of the one [B·T, DV] target distribution: no per-step copies of it are kept
        chunk_ce = partial(self._chunk_ce, tgt["probs"].view(B * T, -1), tgt["argmax"].view(B * T))
        flat = torch.arange(B * T, device=ids.device).view(B, T)
        loss = torch.zeros((), device=ids.device)
        stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for s in range(k):  # every step runs, even without labels: ZeRO-3/FSDP forwards are collective
            m = max(T - 2 - s, 0)  # draft positions t whose label x_{t+2+s} exists
            valid = shifted_valid(batch, 2 + s) if m else ids.new_zeros(B, 0, dtype=torch.bool)  # [B, m]
            n = valid.sum().float()
            h = outs[s][:, :m][valid]  # [n, H]
            rows = flat[:, 1 + s: 1 + s + m][valid]  # [n] rows of the target distribution of x_{t+2+s}
            # loss_checkpoint: each row chunk's [c, DV] logits are recomputed in backward instead of kept
            ce, hits = chunked_sum(chunk_ce, h, rows, vocab=self.draft.config.draft_vocab_size,
                                   checkpoint=self.loss_checkpoint)
            assert hits is not None
            loss = loss + (self.decay ** s) * ce
            stats[f"ce/s{s}"] = (ce.detach(), n)
            stats[f"top1/s{s}"] = (hits[0], n)
            if s == 0:
                stats["oov_argmax"] = ((tgt["argmax"][:, 1: T - 1][valid] < 0).sum().float(), n)
                stats["vocab_mass"] = (tgt["mass"][:, 1: T - 1][valid].sum().float(), n)
        return loss, stats

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], top_k: int = 10) -> tuple[torch.Tensor, int]:
        """Ranks [n, k] of the greedy reference among the draft's depth-d top-k, for the loop's simulated τ.

        Scored positions t: the next k+1 tokens x_{t+1..t+k+1} are assistant tokens equal to the target's own
        greedy choices. Decoding from root x_{t+1} drafts depth d with exactly TTT step d-1 at t (teacher-forced
        on the reference prefix), so its candidates are checked against x_{t+1+d}; a reference token outside
        the draft vocabulary is never a candidate (rank = top_k)."""
        ids = batch["input_ids"]
        B, T = ids.shape
        S, k = T - 1, self.steps
        hidden = batch_hidden(batch, self.target, self.layers)
        win, considered = greedy_windows(batch, hidden[self.top], self.target.lm_head(), k + 1)
        n_pos = win.shape[1]  # T - k - 1 (or 0)
        aux = torch.cat([hidden[a][:, :S] for a in self.aux], dim=-1)
        tokens = torch.cat([ids[:, 1:], ids.new_zeros(B, k - 1)], dim=1)
        pos, step0 = self.draft_inputs(batch)
        outs = self.draft.rollout(aux, tokens, pos, step0, k)
        draft_id_of = draft_ids_of(self.draft.t2d)  # [V], -1 outside the draft vocabulary
        ranks = []
        for s in range(k):  # every step's lm_head runs on every rank, also for n = 0
            ref = ids[:, 2 + s: 2 + s + n_pos][win]  # [n] x_{t+2+s}
            ref_d = draft_id_of[ref]
            top = chunked_topk(outs[s][:, :n_pos][win], self.draft.logits, top_k, self.draft.config.draft_vocab_size)
            ranks.append(reference_ranks(top, ref_d, top_k))
        return torch.stack(ranks, dim=1), considered

    def save_pretrained(self, path, extra: dict[str, Any]) -> None:
        self.draft.save_pretrained(path, self.target.identity, extra)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Resume: weights and the (unchanged) vocabulary mapping from a checkpoint of this same run."""
        for k in ("d2t", "t2d"):
            if k not in state:
                raise ValueError(f"checkpoint state has no {k}: not an EAGLE-3 checkpoint of this run")
            if not torch.equal(state[k].to(getattr(self.draft, k).device), getattr(self.draft, k)):
                raise ValueError(f"checkpoint {k} differs from this draft's vocabulary mapping; the mapping is never "
                                 f"replaced silently (resume builds the draft from the checkpoint)")
        self.draft.load_state_dict(state)


def _from_checkpoint(path: Path, target: FrozenTarget, h: DictConfig, why: str) -> Eagle3Draft:
    """A draft whose architecture and vocabulary come from a checkpoint; explicit head settings must agree."""
    draft = Eagle3Draft.from_pretrained(path, target)
    c = draft.config
    for key, have in (("aux_layers", c.aux_layers), ("draft_vocab_size", c.draft_vocab_size)):
        want = h.get(key)
        if want is not None and (list(want) if key == "aux_layers" else int(want)) != have:
            raise ValueError(f"head.{key}={want} but the checkpoint {path} ({why}) has {have}; its draft vocabulary "
                             f"and architecture are kept — drop the override or start a fresh run")
    if bool(h.norm_before_residual) != c.norm_before_residual:
        raise ValueError(f"head.norm_before_residual={h.norm_before_residual} but the checkpoint {path} ({why}) has "
                         f"{c.norm_before_residual}")
    return draft


def _saved_vocab_stats(path: Path) -> dict[str, Any]:
    """The coverage numbers a checkpoint recorded when its vocabulary was counted, carried into the next one
    (so a resumed or fine-tuned run still says how well its vocabulary covers the data it was counted on).
    Called after the checkpoint has loaded, so its config.json exists and parses."""
    saved = read_head_config(path).get("draft_vocab") or {}
    return {k: v for k, v in saved.items() if k != "source"}


def build_draft(cfg: DictConfig, target: FrozenTarget, data: Any, out_dir: Path) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Fresh draft with a draft vocabulary counted from the training split, or one taken from a checkpoint."""
    h = cfg.head
    ckpts = list_checkpoints(out_dir) if cfg.train.resume else []
    if ckpts:
        p = ckpts[-1][1]
        return _from_checkpoint(p, target, h, "resume"), {**_saved_vocab_stats(p), "source": f"resume:{p}"}
    if h.get("init_from"):
        p = Path(h.init_from)
        return _from_checkpoint(p, target, h, "init_from"), {**_saved_vocab_stats(p), "source": f"init_from:{p}"}
    V = target.vocab_size
    dv = resolve_draft_vocab_size(h.draft_vocab_size, V)
    config = eagle3_config_for(target, None if h.aux_layers is None else list(h.aux_layers), dv,
                               bool(h.norm_before_residual), aux_scale_mode(h.get("aux_scale")) is not False)
    if h.init_lm_head not in ("target", "random"):
        raise ValueError(f"head.init_lm_head must be target or random, got {h.init_lm_head!r}")
    vocab, info = counted_vocab(data, target.tokenizer, V, dv, h.get("draft_vocab_reference"))
    torch.manual_seed(int(cfg.train.seed))  # the draft's init depends on the seed only
    draft = Eagle3Draft(config, target)
    draft.set_vocab(vocab, init_lm_head_from=target.lm_head().weight if h.init_lm_head == "target" else None)
    return draft, info


def freeze_lm_head(draft: Eagle3Draft, h: DictConfig) -> None:
    """head.freeze_lm_head: the draft then only learns features its starting lm_head reads well (as EAGLE does
    with the target's own head), instead of also moving the output rows from the target's."""
    if not h.get("freeze_lm_head", False):
        return
    if h.init_lm_head != "target" and not h.get("init_from"):
        raise ValueError("head.freeze_lm_head=true keeps lm_head at its starting rows, so it needs "
                         f"head.init_lm_head=target (got {h.init_lm_head!r}: a frozen random head)")
    draft.lm_head.weight.requires_grad_(False)


def build(cfg: DictConfig) -> dict[str, Any]:
    """Everything main() needs, exposed so tests can stop and resume the Trainer."""
    acc = make_accelerator(cfg)
    out_dir = resolve_out_dir(cfg)
    target = load_target(cfg.target, device=acc.device)
    with acc.main_process_first():
        data = prepare_data(cfg.data, target.tokenizer)
    h = cfg.head
    draft, vocab_info = build_draft(cfg, target, data, out_dir)
    freeze_lm_head(draft, h)
    draft = draft.to(acc.device)
    objective = Eagle3Objective(draft, target, int(h.ttt_steps), float(h.ttt_decay), bool(h.loss_checkpoint))
    feats = feature_source(cfg, target, data, objective.layers)
    fresh = not str(vocab_info.get("source", "")).startswith(("resume:", "init_from:"))
    scale_info = fix_aux_scale(draft, feats, target, draft.config.aux_layers, acc, fresh,
                               aux_scale_mode(h.get("aux_scale")))
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, out_dir)
        log.info("EAGLE-3: %s layer, aux layers %s, draft vocab %d (%s), %.2fM trainable params, %d TTT steps; "
                 "%d training examples; features %s; feature scale %s", type(draft.layers[0]).__name__,
                 draft.config.aux_layers, draft.config.draft_vocab_size, json.dumps(vocab_info),
                 sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6, objective.steps,
                 len(data.train), feats.source, json.dumps(scale_info))
    extra = {"data": {"name": cfg.data.name, "key": data.stats.get("key"), "rows": data.stats.get("rows")},
             "features": feats.source, "draft_vocab": vocab_info, "ttt_steps": objective.steps,
             "ttt_decay": objective.decay, "freeze_lm_head": bool(h.get("freeze_lm_head", False)), **scale_info}
    # Held-out CE and top-1 agreement with the target per TTT step, and the simulated τ (train.sim_tau_examples,
    # through acceptance_ranks): held-out rows always go through the target (online features).
    evaluate = heldout_evaluator(objective, data.heldout, feats.heldout_collate, acc, int(cfg.train.eval_tokens), extra)
    trainer = Trainer(cfg, acc, objective, feats.train, feats.collate, out_dir, extra, evaluate=evaluate,
                      heldout=data.heldout, heldout_collate=feats.heldout_collate,
                      tau_eval=build_tau_evaluator(cfg, target, data))
    return {"trainer": trainer, "objective": objective, "acc": acc, "out_dir": out_dir, "source": feats.source,
            "vocab": vocab_info}


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    b = build(cfg)
    # ---- loop
    result = b["trainer"].fit()
    # ---- save
    return write_summary(b["acc"], b["out_dir"], "eagle3", result, features=b["source"],
                         ttt_steps=b["objective"].steps, draft_vocab=b["vocab"])


@job.main(config_name="eagle3")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
