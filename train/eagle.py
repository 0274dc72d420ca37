"""Train an EAGLE draft on a frozen target: ``accelerate launch train/eagle.py [overrides]``.

Target features come online (the target runs in this job) or offline (``features.dir=<cache written
by data_prep/features.py>``); both go through data_prep.features, with the same data order, so the
same seed gives the same loss curve either way (up to the cache's storage precision).

Held-out metrics (feature loss, CE, top-1 agreement) and the simulated τ (the greedy chain to depth 6, eval's
default tree depth, or ``+head.sim_depth=N``; see ``EagleObjective.acceptance_ranks``) are logged at every
``train.eval_every`` and at the end, in lockstep over ranks.

Reads top to bottom: setup (devices, target, data, draft, features), loop (shared Trainer), save
(final draft + summary). ``main(cfg)`` is a plain function; tests call it with a composed config.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from draftheads.data_prep.dataset import prepare_data, shifted_valid
from draftheads.data_prep.features import batch_hidden
from draftheads.heads import job
from draftheads.heads.eagle import EagleDraft, eagle_config_for
from draftheads.heads.target import FrozenTarget, load_target
from draftheads.train.common import draft_sequence, feature_source, heldout_evaluator
from draftheads.train.losses import SoftCrossEntropy, chunked_sum, chunked_topk, linear_cross_entropy
from draftheads.train.loop import (Trainer, build_tau_evaluator, greedy_windows, make_accelerator, reference_ranks,
                        resolve_out_dir, save_run_config, write_summary)

log = logging.getLogger(__name__)

NOISE_KINDS = ("uniform", "none")
SIM_DEPTH = 6  # simulated-τ chain depth: eval's default EAGLE tree depth (conf/tree/default.yaml depth)
# Held-out metrics: objective stat -> logged name (the names checkpoints have always recorded)
HELDOUT_NAMES = {"feat": "heldout_feat", "ce": "heldout_ce", "top1/target": "heldout_top1"}


class EagleObjective(nn.Module):
    """w_feat · SmoothL1(pred f_{t+1}, f_{t+1}) + w_tok · CE(draft logits, target's p(x_{t+2} | x_≤t+1)).

    Alignment (pinned by tests/test_eagle.py): draft position t reads (f_t, x_{t+1}) and predicts
    f_{t+1}; lm_head(f_{t+1}) is the target's distribution of x_{t+2}. Both losses count at t when
    x_{t+2} is an assistant token of the same document: ``shifted_valid(batch, 2)``.
    """

    def __init__(self, draft: EagleDraft, target: FrozenTarget, w_feat: float = 1.0, w_tok: float = 0.1,
                 noise: str = "uniform", noise_scale: float = 0.1, sim_depth: int = SIM_DEPTH):
        super().__init__()
        if noise not in NOISE_KINDS:
            raise ValueError(f"head.noise must be one of {NOISE_KINDS}, got {noise!r}")
        if noise_scale < 0:
            raise ValueError(f"head.noise_scale must be >= 0, got {noise_scale}")
        if sim_depth < 1:
            raise ValueError(f"head.sim_depth must be >= 1, got {sim_depth}")
        self.draft = draft
        object.__setattr__(self, "target", target)  # unregistered: never optimized, wrapped or saved
        self.w_feat, self.w_tok = float(w_feat), float(w_tok)
        self.noise, self.noise_scale = noise, float(noise_scale)
        self.sim_depth = int(sim_depth)
        self.feature_layer = draft.config.resolved_layer
        self.top = target.num_layers  # layer L: the target's logits are lm_head(f^L)
        self.layers = sorted({self.feature_layer, self.top})  # what the features source must provide

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_valid(batch, 2).sum()

    def draft_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, T-1] and the causal (per-document) mask [B, T-1, T-1] of the draft's sequence."""
        return draft_sequence(batch)

    def predict(self, batch: dict[str, torch.Tensor], hidden: dict[int, torch.Tensor], noise: bool,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pred [n, H], target feature [n, H], target top-layer feature [n, H], valid [B, T-2])."""
        ids = batch["input_ids"]
        T = ids.shape[1]
        f = hidden[self.feature_layer]  # [B, T, H]
        f_in = f[:, : T - 1].float()  # [B, T-1, H] f_t
        if noise and self.noise == "uniform" and self.noise_scale > 0:
            f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * self.noise_scale
        pos, allowed = self.draft_inputs(batch)
        pred = self.draft(f_in, ids[:, 1:], pos, allowed)  # [B, T-1, H] predicted f_{t+1}
        valid = shifted_valid(batch, 2)  # [B, T-2]: x_{t+2} is a label
        p = pred[:, : T - 2][valid]  # [n, H]
        tf = f[:, 1: T - 1][valid]  # [n, H] f_{t+1}
        tl = hidden[self.top][:, 1: T - 1][valid]  # [n, H] f^L_{t+1}
        return p, tf, tl, valid

    def forward(self, batch: dict[str, torch.Tensor]):
        hidden = batch_hidden(batch, self.target, self.layers)
        p, tf, tl, valid = self.predict(batch, hidden, noise=self.training)
        n = valid.sum().float()
        feat = F.smooth_l1_loss(p.float(), tf.float(), reduction="none").mean(-1).sum()  # Σ_t mean_H
        labels = batch["input_ids"][:, 2:][valid]  # [n] x_{t+2}
        # draft and target [rows, V] logits one row chunk at a time, never [n, V]: through the frozen lm_head the
        # gradient is taken with the loss (no recomputation); otherwise the chunks are recomputed in backward
        head, tdtype = self.target.lm_head(), self.target.dtype

        def target_probs(i: int, j: int) -> torch.Tensor:  # [j - i, V] the target's next-token distribution
            return torch.softmax(head(tl[i:j].to(tdtype)).float(), dim=-1)

        fused = linear_cross_entropy(self.draft.lm_head_input(p), self.draft.frozen_lm_head(), labels, 5,
                                     target_probs)
        ce, hits = fused if fused is not None else chunked_sum(self._chunk_ce, p, tl, labels,
                                                               vocab=self.draft.config.vocab_size)
        assert hits is not None
        loss = self.w_feat * feat + self.w_tok * ce
        stats = {"feat": (feat.detach(), n), "ce": (ce.detach(), n), "top1/target": (hits[0], n),
                 "top5/target": (hits[1], n), "top1/label": (hits[2], n)}
        return loss, stats

    def _chunk_ce(self, p: torch.Tensor, tl: torch.Tensor, labels: torch.Tensor, stats: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Σ soft-CE(draft logits of p, target's softmax of tl) over a row chunk (p, tl [rows, H], labels [rows]);
        with ``stats`` also [top-1 = target argmax, target argmax in top-5, top-1 = label] counts."""
        z = self.draft.logits(p).float()  # [rows, V]
        with torch.no_grad():
            tprob = torch.softmax(self.target.lm_head()(tl.to(self.target.dtype)).float(), dim=-1)  # [rows, V]
        ce, _ = SoftCrossEntropy.apply(z, tprob)
        if not stats:
            return ce, None
        with torch.no_grad():
            top5 = z.topk(min(5, z.shape[-1]), dim=-1).indices  # [rows, 5]
            tgt = tprob.argmax(-1)  # [rows] the target's greedy token
            hits = torch.stack([(top5[:, 0] == tgt).sum(), (top5 == tgt[:, None]).any(-1).sum(),
                                (top5[:, 0] == labels).sum()]).float()
        return ce, hits

    @torch.no_grad()
    def chain_rollout(self, features: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, step0: torch.Tensor,
                      depth: int) -> list[torch.Tensor]:
        """The draft's greedy chain along the reference, from every position t at once: ``depth`` outputs [B, S, H].

        Block 0 is the teacher-forced pass: t reads (f_t, x_{t+1}) at position pos_t with ``step0``'s causal
        mask, and predicts f_{t+1} (depth-1 candidates x_{t+2}). Block s >= 1 at t reads (block s-1's output at
        t, x_{t+1+s}) at position pos_t + s and attends to block 0's keys that t may see plus blocks 1..s at t
        only; it predicts the depth-(s+1) candidates x_{t+2+s}. That is exactly eval.eagle_drafter's chain at a
        step whose root x_{t+1} follows the target's features f_<=t, when the drafted tokens so far are the
        reference's: committed pairs with the target's real features, then the chain's own entries with the
        draft's predicted features. One cached forward per block (keys grow by S each)."""
        from transformers import DynamicCache

        B, S = pos.shape
        cache = DynamicCache(config=self.draft.layer_config)
        tokens = torch.cat([ids[:, 1:], ids.new_zeros(B, depth - 1)], dim=1)  # [B, S+depth-1]; the tail is never scored
        own = torch.eye(S, dtype=torch.bool, device=ids.device)[None].expand(B, S, S)
        h, outs = features, []
        for s in range(depth):  # every block runs on every rank, also without scored positions
            allowed = torch.cat([step0] + [own] * s, dim=-1)  # [B, S, (s+1)·S]
            h = self.draft(h, tokens[:, s: s + S], pos + s, allowed, cache)
            outs.append(h)
        return outs

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], top_k: int = 10) -> tuple[torch.Tensor, int]:
        """Ranks [n, D] of the greedy reference among the draft's depth-d top-k (D = ``sim_depth``), for the loop's
        simulated τ (train.loop.Trainer.simulated_tau).

        Scored positions t: x_{t+1..t+D+1} are assistant tokens equal to the target's own greedy choices
        (``greedy_windows``), so a greedy decoding step can start with the target's features f_<=t and root
        x_{t+1}. Depth d's candidates there are the top-k of lm_head(draft output) after drafting along the
        reference x_{t+2..t+d} (``chain_rollout``): depth 1 is the teacher-forced prediction of f_{t+1}; depths
        >= 2 read the draft's own predicted features, as drafting does. Checked against x_{t+1+d}. So the chain
        figure is what eval's ``tree.kind=chain tree.depth=D`` would accept at such a step (up to numerics: the
        target's features here come from one teacher-forced forward, not from the verification passes).
        EAGLE's eval tree is dynamic (EAGLE-2: shaped by the draft's scores), so no static tree is simulated
        (no ``sim_tree_paths``). Positions where the held-out text leaves the greedy path are not scored."""
        ids = batch["input_ids"]
        T = ids.shape[1]
        D = self.sim_depth
        hidden = batch_hidden(batch, self.target, self.layers)
        win, considered = greedy_windows(batch, hidden[self.top], self.target.lm_head(), D + 1)
        n_pos = win.shape[1]  # T - D - 1 (or 0)
        pos, step0 = self.draft_inputs(batch)
        outs = self.chain_rollout(hidden[self.feature_layer][:, : T - 1].float(), ids, pos, step0, D)
        ranks = []
        for s in range(D):  # depth s+1; the lm_head runs on every rank, also for n = 0
            ref = ids[:, 2 + s: 2 + s + n_pos][win]  # [n] x_{t+2+s}
            top = chunked_topk(outs[s][:, :n_pos][win], self.draft.logits, top_k, self.draft.config.vocab_size)
            ranks.append(reference_ranks(top, ref, top_k))
        return torch.stack(ranks, dim=1), considered

    def save_pretrained(self, path, extra: dict[str, Any]) -> None:
        self.draft.save_pretrained(path, self.target.identity, extra)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.draft.load_state_dict(state)


def build(cfg: DictConfig) -> dict[str, Any]:
    """Everything main() needs, exposed so tests can stop and resume the Trainer."""
    acc = make_accelerator(cfg)
    out_dir = resolve_out_dir(cfg)
    target = load_target(cfg.target, device=acc.device)
    with acc.main_process_first():
        data = prepare_data(cfg.data, target.tokenizer)
    h = cfg.head
    head_cfg = eagle_config_for(target, int(h.feature_layer), bool(h.fc_bias))
    torch.manual_seed(int(cfg.train.seed))  # the draft's init depends on the seed only, not on what loaded before
    draft = EagleDraft(head_cfg, target).to(acc.device)
    objective = EagleObjective(draft, target, float(h.w_feat), float(h.w_tok), str(h.noise), float(h.noise_scale),
                               job.config_int(h, "sim_depth", SIM_DEPTH, 1, "head"))
    feats = feature_source(cfg, target, data, objective.layers)
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, out_dir)
        log.info("EAGLE: %s layer on feature layer %d, %.2fM trainable params; %d training examples; features %s",
                 type(draft.layer).__name__, head_cfg.resolved_layer,
                 sum(p.numel() for p in draft.parameters()) / 1e6, len(data.train), feats.source)
    extra = {"data": {"name": cfg.data.name, "key": data.stats.get("key"), "rows": data.stats.get("rows")},
             "features": feats.source}
    evaluate = heldout_evaluator(objective, data.heldout, feats.heldout_collate, acc, int(cfg.train.eval_tokens),
                                 extra, HELDOUT_NAMES)
    # held-out rows (metrics, simulated τ) always go through the target: online features
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
    return write_summary(b["acc"], b["out_dir"], "eagle", result, features=b["source"])


@job.main(config_name="eagle")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
