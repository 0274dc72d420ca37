"""Train an EAGLE draft on a frozen target: ``accelerate launch train/eagle.py [overrides]``.

Target features come online (the target runs in this job) or offline (``features.dir=<cache written
by data_prep/features.py>``); both go through data_prep.features, with the same data order, so the
same seed gives the same loss curve either way (up to the cache's storage precision).

Reads top to bottom: setup (devices, target, data, draft, features), loop (shared Trainer), save
(final draft + summary). ``main(cfg)`` is a plain function; tests call it with a composed config.
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

from data_prep.dataset import collate, prepare_data, shifted_valid
from data_prep.features import batch_hidden, training_features
from heads.eagle import EagleDraft, eagle_config_for
from heads.target import FrozenTarget, load_target
from train.loop import Trainer, make_accelerator, resolve_out_dir, save_run_config

log = logging.getLogger(__name__)

NOISE_KINDS = ("uniform", "none")


class EagleObjective(nn.Module):
    """w_feat · SmoothL1(pred f_{t+1}, f_{t+1}) + w_tok · CE(draft logits, target's p(x_{t+2} | x_≤t+1)).

    Alignment (pinned by tests/test_eagle.py): draft position t reads (f_t, x_{t+1}) and predicts
    f_{t+1}; lm_head(f_{t+1}) is the target's distribution of x_{t+2}. Both losses count at t when
    x_{t+2} is an assistant token of the same document: ``shifted_valid(batch, 2)``.
    """

    def __init__(self, draft: EagleDraft, target: FrozenTarget, w_feat: float = 1.0, w_tok: float = 0.1,
                 noise: str = "uniform", noise_scale: float = 0.1):
        super().__init__()
        if noise not in NOISE_KINDS:
            raise ValueError(f"head.noise must be one of {NOISE_KINDS}, got {noise!r}")
        if noise_scale < 0:
            raise ValueError(f"head.noise_scale must be >= 0, got {noise_scale}")
        self.draft = draft
        object.__setattr__(self, "target", target)  # unregistered: never optimized, wrapped or saved
        self.w_feat, self.w_tok = float(w_feat), float(w_tok)
        self.noise, self.noise_scale = noise, float(noise_scale)
        self.feature_layer = draft.config.resolved_layer
        self.top = target.num_layers  # layer L: the target's logits are lm_head(f^L)
        self.layers = sorted({self.feature_layer, self.top})  # what the features source must provide

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_valid(batch, 2).sum()

    def draft_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, T-1] and the causal (per-document) mask [B, T-1, T-1] of the draft's sequence."""
        ids = batch["input_ids"]
        B, T = ids.shape
        S = T - 1
        causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
        if "doc_ids" in batch:
            doc = batch["doc_ids"][:, :S]
            allowed = causal[None] & (doc[:, :, None] == doc[:, None, :])
            pos = batch["position_ids"][:, :S]
        else:
            allowed = causal[None].expand(B, S, S)
            pos = torch.arange(S, device=ids.device)[None].expand(B, S)
        return pos, allowed

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
        logp = torch.log_softmax(self.draft.logits(p).float(), dim=-1)  # [n, V]
        with torch.no_grad():
            tprob = torch.softmax(self.target.lm_head()(tl.to(self.target.dtype)).float(), dim=-1)  # [n, V]
        ce = -(tprob * logp).sum()
        loss = self.w_feat * feat + self.w_tok * ce
        with torch.no_grad():
            labels = batch["input_ids"][:, 2:][valid]  # [n] x_{t+2}
            top5 = logp.topk(5, dim=-1).indices  # [n, 5]
            tgt = tprob.argmax(-1)  # [n] the target's greedy token
            stats = {"feat": (feat.detach(), n), "ce": (ce.detach(), n),
                     "top1/target": ((top5[:, 0] == tgt).sum().float(), n),
                     "top5/target": ((top5 == tgt[:, None]).any(-1).sum().float(), n),
                     "top1/label": ((top5[:, 0] == labels).sum().float(), n)}
        return loss, stats

    def save_pretrained(self, path, extra: dict[str, Any]) -> None:
        self.draft.save_pretrained(path, self.target.identity, extra)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.draft.load_state_dict(state)


@torch.no_grad()
def held_out_metrics(objective: EagleObjective, heldout: Any, batch_fn, acc, max_tokens: int) -> dict[str, float]:
    """Held-out feature loss, CE and top-1 agreement with the target (online features, no noise)."""
    was = objective.training
    objective.eval()
    sums = torch.zeros(4, dtype=torch.float64)
    rows = list(range(acc.process_index, len(heldout), acc.num_processes))
    seen = 0
    with acc.autocast():
        for i in range(0, len(rows), 4):
            if seen >= max_tokens:
                break
            b = {k: v.to(acc.device) for k, v in batch_fn([heldout[j] for j in rows[i:i + 4]]).items()}
            _, st = objective(b)
            sums += torch.tensor([float(st["feat"][0]), float(st["ce"][0]), float(st["top1/target"][0]),
                                  float(st["feat"][1])], dtype=torch.float64)
            seen += int(b["attention_mask"].sum())
    objective.train(was)
    if acc.num_processes > 1:
        sums = acc.reduce(sums.to(acc.device), "sum").cpu()
    if sums[3] == 0:
        return {}
    return {"heldout_feat": float(sums[0] / sums[3]), "heldout_ce": float(sums[1] / sums[3]),
            "heldout_top1": float(sums[2] / sums[3])}


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
    objective = EagleObjective(draft, target, float(h.w_feat), float(h.w_tok), str(h.noise), float(h.noise_scale))
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    features_dir = cfg.get("features", {}).get("dir")
    train_data, batch_fn, source = training_features(features_dir, target, data, objective.layers, pad_id)
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(cfg, out_dir)
        log.info("EAGLE: %s layer on feature layer %d, %.2fM trainable params; %d training examples; features %s",
                 type(draft.layer).__name__, head_cfg.resolved_layer,
                 sum(p.numel() for p in draft.parameters()) / 1e6, len(data.train), source)
    extra = {"data": {"name": cfg.data.name, "key": data.stats.get("key"), "rows": data.stats.get("rows")},
             "features": source}
    heldout_fn = lambda rows: collate(rows, pad_id)  # noqa: E731  (held-out metrics always use online features)

    def evaluate(step: int) -> dict[str, Any]:
        m = held_out_metrics(objective, data.heldout, heldout_fn, acc, int(cfg.train.eval_tokens))
        if m:
            extra["heldout"] = {k: round(v, 5) for k, v in m.items()}
        return m

    trainer = Trainer(cfg, acc, objective, train_data, batch_fn, out_dir, extra, evaluate=evaluate)
    return {"trainer": trainer, "objective": objective, "acc": acc, "out_dir": out_dir, "source": source}


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux), so the training peak is not the model-loading peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_mb() -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def main(cfg: DictConfig) -> dict[str, Any]:
    # ---- setup
    b = build(cfg)
    acc, out_dir = b["acc"], b["out_dir"]
    # ---- loop
    reset = _reset_peak_rss()
    result = b["trainer"].fit()
    loop_peak = _vm_hwm_mb() if reset else None
    # ---- save
    summary = {"family": "eagle", "features": b["source"], "out_dir": str(out_dir), "final": str(result.final_dir),
               "steps": result.steps, "seconds": round(result.seconds, 1),
               "train_tokens_per_s": round(result.tokens_per_s, 1), "peak_rss_mb": round(result.peak_memory_mb, 1),
               "peak_rss_loop_mb": None if loop_peak is None else round(loop_peak, 1),
               "losses": [round(r["loss"], 6) for r in result.history],
               "last": result.history[-1] if result.history else {}}
    if acc.is_main_process:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("done: %s", json.dumps(summary))
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="eagle")
def _hydra_main(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _hydra_main()
