"""Train Medusa heads on a frozen target: ``accelerate launch train/medusa.py [overrides]``.

Reads top to bottom: setup (devices, target, data, heads), loop (shared Trainer), save (final
head + summary). ``main(cfg)`` is a plain function; tests call it with a composed config.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from data_prep.dataset import collate, model_inputs, prepare_data, shifted_valid
from heads.medusa import MedusaHeads, medusa_config_for
from heads.target import FrozenTarget, load_target
from train.loop import Trainer, make_accelerator, resolve_out_dir, save_run_config

log = logging.getLogger(__name__)


class MedusaObjective(nn.Module):
    """Σ_k w^k · CE_k over assistant tokens; head k (1-based) at position t is scored on token t+k+1."""

    def __init__(self, heads: MedusaHeads, target: FrozenTarget, decay: float = 0.8):
        super().__init__()
        self.heads = heads
        object.__setattr__(self, "target", target)  # unregistered: never optimized, wrapped or saved
        self.decay = decay

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_valid(batch, 2).sum()  # head 1's labels: the normalizer for all heads

    def forward(self, batch: dict[str, torch.Tensor]):
        if "hidden_last" in batch:  # offline features
            hidden = batch["hidden_last"]
        else:
            hidden = self.target(**model_inputs(batch), logits=False)["last_hidden"]  # [B, T, H]
        ids = batch["input_ids"]
        T = ids.shape[1]
        loss = hidden.new_zeros((), dtype=torch.float32)
        stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k in range(1, self.heads.config.num_heads + 1):
            if k + 1 >= T:
                break
            valid = shifted_valid(batch, k + 1)  # [B, T-k-1]
            h = hidden[:, : T - k - 1][valid]  # [n, H]
            labels = ids[:, k + 1:][valid]  # [n]
            n = labels.new_tensor(labels.numel(), dtype=torch.float32)
            if labels.numel() == 0:
                continue
            logits = self.heads.project(k - 1, self.heads.head_hidden(k - 1, h.to(torch.float32))).float()  # [n, V]
            ce = F.cross_entropy(logits, labels, reduction="sum")
            loss = loss + (self.decay ** k) * ce
            with torch.no_grad():
                top5 = logits.topk(5, dim=-1).indices  # [n, 5]
                stats[f"ce/{k}"] = (ce.detach(), n)
                stats[f"top1/{k}"] = ((top5[:, 0] == labels).sum().float(), n)
                stats[f"top5/{k}"] = ((top5 == labels[:, None]).any(-1).sum().float(), n)
        return loss, stats

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
            if k + 1 >= T:
                break
            valid = shifted_valid(batch, k + 1)
            h = hidden[:, : T - k - 1][valid]
            labels = ids[:, k + 1:][valid]
            logits = self.heads.project(k - 1, self.heads.head_hidden(k - 1, h.to(torch.float32)))
            top = logits.topk(top_k, dim=-1).indices  # [n, top_k]
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
    rows = list(range(acc.process_index, len(heldout), acc.num_processes))
    seen = 0
    with acc.autocast():
        for i in range(0, len(rows), 4):
            if seen >= max_tokens:
                break
            b = batch_fn([heldout[j] for j in rows[i:i + 4]])
            b = {k: v.to(acc.device) for k, v in b.items()}
            h, c = objective.rank_hits(b)
            hits += h
            n += c
            seen += int(b["attention_mask"].sum())
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
    objective = MedusaObjective(heads, target, float(cfg.head.loss_decay))
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
        extra["rank_accuracy"] = [[round(a, 5) for a in row] for row in rank_acc]
        extra["rank_accuracy_tokens"] = int(n[0])
        return {f"heldout_top1/{k + 1}": rank_acc[k][0] for k in range(len(rank_acc))}

    trainer = Trainer(cfg, acc, objective, data.train, batch_fn, out_dir, extra, evaluate=evaluate)
    # ---- loop
    result = trainer.fit()
    # ---- save
    summary = {"family": "medusa", "out_dir": str(out_dir), "final": str(result.final_dir), "steps": result.steps,
               "seconds": round(result.seconds, 1), "train_tokens_per_s": round(result.tokens_per_s, 1),
               "peak_rss_mb": round(result.peak_memory_mb, 1),
               "last": result.history[-1] if result.history else {}}
    if acc.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("done: %s", json.dumps(summary))
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="medusa")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
