"""Train Medusa heads on a frozen target: ``accelerate launch train/medusa.py [overrides]``.

Reads top to bottom: setup (devices, target, data, heads), loop (shared Trainer), save (final
head + summary). ``main(cfg)`` is a plain function; tests call it with a composed config.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable

from hydra.utils import instantiate
import torch
from omegaconf import DictConfig
from torch import nn

from draftheads.data_prep.dataset import collate, model_inputs, prepare_data, shifted_valid
from draftheads.heads import job
from draftheads.heads.medusa import MedusaHeads, medusa_config_for
from draftheads.heads.target import FrozenTarget, load_target
from draftheads.train.losses import chunked_sum, chunked_topk, cross_entropy_hits, linear_cross_entropy, vocab_of
from draftheads.train.loop import (Trainer, build_tau_evaluator, lockstep_batches, make_accelerator, resolve_out_dir,
                        save_run_config, write_summary)

log = logging.getLogger(__name__)


class MedusaObjective(nn.Module):
    """Σ_k w^k · CE_k over assistant tokens; head k (1-based) at position t is scored on token t+k+1."""

    def __init__(self, heads: MedusaHeads, target: FrozenTarget, decay: float = 0.8,
                 sim_tree: Callable[..., Any] | None = None):
        super().__init__()
        self.heads = heads
        # (num_heads, acc=rank accuracies) -> a static tree with .paths (conf/head/medusa.yaml sim_tree); None: chain
        self.sim_tree = sim_tree
        object.__setattr__(self, "target", target)  # unregistered: never optimized, wrapped or saved
        self.decay = decay
        self.rank_accuracy: list[list[float]] | None = None  # latest held-out per-rank hit rates (tune the tree)

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_valid(batch, 2).sum()  # head 1's labels: the normalizer for all heads

    def forward(self, batch: dict[str, torch.Tensor]):
        if "hidden_last" in batch:  # offline features
            hidden = batch["hidden_last"]
        else:
            hidden = self.target(**model_inputs(batch), logits=False)["last_hidden"]  # [B, T, H]
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k in range(1, self.heads.config.num_heads + 1):
            # Every head runs on every micro-batch, even with no labels: DDP expects all parameters to get
            # gradients and ZeRO-3/FSDP forwards are collective, so no rank may skip a head.
            h, labels = self._head_inputs(batch, hidden, k)
            n = labels.new_tensor(labels.numel(), dtype=torch.float32)
            hk = self.heads.head_hidden(k - 1, h.to(torch.float32))  # [n, H]
            # [rows, V] logits one row chunk at a time, never [n, V] per head: through the shared frozen lm_head the
            # gradient is taken with the loss; a head's own lm_head recomputes its chunks in backward
            fused = linear_cross_entropy(hk, self.heads.shared_projection(), labels, 5)
            ce, hits = fused if fused is not None else chunked_sum(partial(self._chunk_ce, k - 1), hk, labels,
                                                                   vocab=self.heads.config.vocab_size)
            loss = loss + (self.decay ** k) * ce
            assert hits is not None
            stats[f"ce/{k}"] = (ce.detach(), n)
            stats[f"top1/{k}"] = (hits[0], n)
            stats[f"top5/{k}"] = (hits[1], n)
        return loss, stats

    def _chunk_ce(self, k: int, h: torch.Tensor, labels: torch.Tensor, stats: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Σ CE of head k (0-based) over a row chunk h [rows, H] (+ top-1/top-5 hit counts): train.losses."""
        return cross_entropy_hits(self.heads.project(k, h), labels, 5, stats)

    def _topk(self, k: int, h: torch.Tensor, top_k: int) -> torch.Tensor:
        """Head k's (0-based) top-k ids [n, top_k] at hidden states h [n, H], without [n, V] logits."""
        return chunked_topk(self.heads.head_hidden(k, h), partial(self.heads.project, k), top_k,
                            self.heads.config.vocab_size)

    @staticmethod
    def _head_inputs(batch: dict[str, torch.Tensor], hidden: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [n, H] at positions t scored for head k (1-based) and their labels x_{t+k+1} [n]."""
        ids = batch["input_ids"]
        T = ids.shape[1]
        if k + 1 >= T:  # sequence too short for this head: empty, but the head still runs
            return hidden.new_zeros(0, hidden.shape[-1]), ids.new_zeros(0)
        valid = shifted_valid(batch, k + 1)  # [B, T-k-1]
        return hidden[:, : T - k - 1][valid], ids[:, k + 1:][valid]

    @torch.no_grad()
    def acceptance_ranks(self, batch: dict[str, torch.Tensor], top_k: int = 10) -> tuple[torch.Tensor, int]:
        """Ranks [n, K] of the greedy reference among each head's top-k, for the loop's simulated τ.

        Scored positions t: the next K+1 held-out tokens are assistant tokens that equal the target's own
        greedy choices (teacher-forced argmax), so they are what greedy decoding from t would produce and
        head k's candidates at h_t are checked against x_{t+k+1} (see Trainer.simulated_tau)."""
        hidden = self.target(**model_inputs(batch), logits=False)["last_hidden"]  # [B, T, H]
        ids = batch["input_ids"]
        B, T = ids.shape
        K = self.heads.config.num_heads
        lm = self.target.lm_head()
        greedy = chunked_topk(hidden.reshape(B * T, -1), lm, 1, vocab_of(lm)).view(B, T)  # prediction of token t+1
        nxt = shifted_valid(batch, 1)  # [B, T-1]: token t+1 is an assistant token
        follows = nxt & (ids[:, 1:] == greedy[:, :-1])  # [B, T-1]
        W = K + 1
        n_pos = max(T - W, 0)
        win = follows.unfold(1, W, 1).all(-1) if n_pos > 0 else follows.new_zeros(B, 0)  # [B, T-W]
        h = hidden[:, :n_pos][win].float()  # [n, H]
        ranks = []
        for k in range(1, K + 1):  # all heads run on every rank (collective under ZeRO-3/FSDP)
            labels = ids[:, k + 1: k + 1 + n_pos][win]  # [n]
            top = self._topk(k - 1, h, top_k)  # [n, top_k]
            hit = top == labels[:, None]
            ranks.append(torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, top_k)))
        return torch.stack(ranks, dim=1), int(nxt.sum())

    def sim_tree_paths(self) -> list[tuple[int, ...]] | None:
        """The static tree eval would build (``sim_tree``), tuned to the latest held-out rank accuracies when known;
        None (chain only) without one."""
        if self.sim_tree is None:
            return None
        return list(self.sim_tree(self.heads.config.num_heads, acc=self.rank_accuracy).paths)

    @torch.no_grad()
    def rank_hits(self, batch: dict[str, torch.Tensor], top_k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
        """hits[k, r] = labels of head k+1 equal to its rank-r candidate; n[k] = labels counted.

        Measured on held-out data these give the per-rank acceptance probabilities that tune the
        static tree used at eval time (see eval.trees.tree_from_accuracies)."""
        hidden = self.target(**model_inputs(batch), logits=False)["last_hidden"]
        ids, T, K = batch["input_ids"], batch["input_ids"].shape[1], self.heads.config.num_heads
        hits = torch.zeros(K, top_k)
        n = torch.zeros(K)
        for k in range(1, K + 1):
            h, labels = self._head_inputs(batch, hidden, k)
            top = self._topk(k - 1, h.to(torch.float32), top_k)  # [n, top_k]
            hits[k - 1] += (top == labels[:, None]).sum(0).float().cpu()
            n[k - 1] += labels.numel()
        return hits, n

    def save_pretrained(self, path, extra: dict[str, Any]) -> None:
        self.heads.save_pretrained(path, self.target.identity, extra)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.heads.load_state_dict(state)


@torch.no_grad()
def held_out_hits(objective: MedusaObjective, heldout: Any, batch_fn, acc, max_tokens: int):
    """Accumulate rank hits over held-out rows (up to ~max_tokens tokens), summed over processes."""
    K = objective.heads.config.num_heads
    hits, n = torch.zeros(K, 10), torch.zeros(K)
    n_rows, seen = 0, 0  # the first rows up to ~max_tokens tokens, the same on every rank
    for length in (heldout["input_ids"] if len(heldout) else []):
        if seen >= max_tokens:
            break
        seen += len(length)
        n_rows += 1
    with acc.autocast():
        for idx, counted in lockstep_batches(n_rows, 4, acc):
            b = batch_fn([heldout[j] for j in idx])
            b = {k: v.to(acc.device) for k, v in b.items()}
            h, c = objective.rank_hits(b)
            if counted:
                hits += h
                n += c
    if acc.num_processes > 1:
        hits, n = acc.reduce(hits.to(acc.device), "sum").cpu(), acc.reduce(n.to(acc.device), "sum").cpu()
    return hits, n


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    acc = make_accelerator(cfg)
    out_dir = resolve_out_dir(cfg)
    target = load_target(cfg.target, device=acc.device)
    with acc.main_process_first():
        data = prepare_data(cfg.data, target.tokenizer)
    head_cfg = medusa_config_for(target, cfg.head.num_heads, cfg.head.num_layers, cfg.head.share_lm_head)
    heads = MedusaHeads(head_cfg, target.lm_head()).to(acc.device)
    sim_tree = instantiate(cfg.head.sim_tree) if cfg.head.get("sim_tree") else None
    objective = MedusaObjective(heads, target, float(cfg.head.loss_decay), sim_tree)
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, out_dir)
        log.info("Medusa: %d heads × %d blocks, %.1fM trainable params; %d training examples",
                 head_cfg.num_heads, head_cfg.num_layers,
                 sum(p.numel() for p in heads.parameters()) / 1e6, len(data.train))
    extra = {"data": {"name": cfg.data.name, "key": data.stats.get("key"), "rows": data.stats.get("rows")}}
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    batch_fn = lambda rows: collate(rows, pad_id)  # noqa: E731

    def evaluate(step: int) -> dict[str, Any]:
        """Held-out per-head top-k hit rates; the final ones go into the checkpoint to tune eval trees."""
        hits, n = held_out_hits(objective, data.heldout, batch_fn, acc, int(cfg.train.eval_tokens))
        if n[0] == 0:  # no held-out split: the eval tree falls back to a generic profile
            return {}
        rank_acc = (hits / n.clamp(min=1)[:, None]).tolist()
        objective.rank_accuracy = rank_acc
        extra["rank_accuracy"] = [[round(a, 5) for a in row] for row in rank_acc]
        extra["rank_accuracy_tokens"] = int(n[0])
        return {f"heldout_top1/{k + 1}": rank_acc[k][0] for k in range(len(rank_acc))}

    trainer = Trainer(cfg, acc, objective, data.train, batch_fn, out_dir, extra, evaluate=evaluate,
                      heldout=data.heldout, tau_eval=build_tau_evaluator(cfg, target, data))
    # ---- loop
    result = trainer.fit()
    # ---- save
    return write_summary(acc, out_dir, "medusa", result)


@job.main(config_name="medusa")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
