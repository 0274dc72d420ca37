"""What the loop needs to order data and steps: the objective protocol a family implements, the
deterministic global-batch order (the same on 1 process x batch 2B as on 2 x B), the lr schedule, and
lock-step batches for work every rank must do together."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch


log = logging.getLogger(__name__)

class Objective(Protocol):
    """What a family supplies to the loop (see module doc)."""

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        ...

    def num_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Number of valid loss tokens in a micro-batch (the normalizer)."""
        ...

    def save_pretrained(self, path: Path, extra: dict[str, Any]) -> None:
        ...

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the tensors ``save_pretrained`` wrote (resume in single/DDP modes)."""
        ...

    # Optional, for the simulated τ the loop logs on held-out data (see ``Trainer.simulated_tau``):
    #   acceptance_ranks(batch) -> (LongTensor [n, D], int): at each of n scored positions, the rank of the
    #       greedy reference token among the draft's depth-d candidates (d = 1..D, conditioned on the
    #       reference prefix; any value >= top_k means "not among the candidates"; D fixed), and how many
    #       positions were considered before the greedy-continuation filter (for the coverage figure).
    #       Under ZeRO-3/FSDP it must call the same draft modules on every rank, even for n = 0.
    #   sim_tree_paths() -> list of rank paths (the static tree eval would verify), or None for chain only.


# ------------------------------------------------------------------------------------------
# Deterministic data order
# ------------------------------------------------------------------------------------------

class GlobalBatches:
    """Yields this rank's micro-batches (lists of dataset indices) for optimizer steps ``start..``.

    The data order is a function of (seed, epoch) only: epoch e visits ``randperm(n, seed + e)``, and
    optimizer step s takes positions ``[s·G, (s+1)·G)`` of that endless stream, G = micro × world × accum.
    Resuming at step s is therefore just starting the stream at s — no loader state to restore — and
    any process layout with the same G sees the same examples in each step.
    """

    def __init__(self, lengths: Sequence[int], micro_batch: int, world: int, rank: int, accum: int, seed: int,
                 group_by_length: bool = True):
        self.lengths = np.asarray(lengths)
        self.n = len(lengths)
        self.micro, self.world, self.rank, self.accum, self.seed = micro_batch, world, rank, accum, seed
        self.global_batch = micro_batch * world * accum
        self.group_by_length = group_by_length
        self._perms: dict[int, np.ndarray] = {}
        if self.n < self.global_batch:
            raise ValueError(f"the training set has {self.n} examples, fewer than one global batch "
                             f"({micro_batch} × {world} processes × {accum} accumulation = {self.global_batch})")

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).numpy()}
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        """All G indices of optimizer step ``step`` (every rank computes the same list)."""
        out = []
        for p in range(step * self.global_batch, (step + 1) * self.global_batch):
            out.append(int(self._perm(p // self.n)[p % self.n]))
        return out

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's ``accum`` micro-batches of step ``step``."""
        idx = self.step_indices(step)
        if self.group_by_length:  # similar lengths share a micro-batch: less padding, same example set
            idx = sorted(idx, key=lambda i: (-int(self.lengths[i]), i))
        chunks = [idx[j:j + self.micro] for j in range(0, len(idx), self.micro)]  # world·accum chunks
        # chunk c goes to rank c % world, micro-step c // world
        return [chunks[a * self.world + self.rank] for a in range(self.accum)]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n


# ------------------------------------------------------------------------------------------
# Schedule
# ------------------------------------------------------------------------------------------

def lr_lambda(warmup: int, total: int, min_ratio: float = 0.0, schedule: str = "cosine") -> Callable[[int], float]:
    """Linear warmup to 1, then cosine (or constant / linear) decay to ``min_ratio``."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return min_ratio + (1 - min_ratio) * (1 - prog)
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
        raise ValueError(f"optim.schedule must be cosine, linear or constant, got {schedule!r}")
    return f


def lockstep_batches(num_rows: int, batch_size: int, acc: Any) -> list[tuple[list[int], bool]]:
    """This rank's share of rows 0..num_rows-1 as (indices, counted) batches, the same number on every rank.

    Why: under ZeRO-3/FSDP (draft or target sharded) every forward is collective, so a rank that stops
    early would leave the others waiting forever. Ranks short of a batch in the last round repeat batch 0
    with counted=False (run, but not added to the metrics)."""
    batches = [list(range(i, min(i + batch_size, num_rows))) for i in range(0, num_rows, batch_size)]
    world, rank = acc.num_processes, acc.process_index
    rounds = -(-len(batches) // world)
    out = []
    for r in range(rounds):
        j = r * world + rank
        out.append((batches[j], True) if j < len(batches) else (batches[0], False))
    return out
