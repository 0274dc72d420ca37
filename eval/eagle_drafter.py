"""EAGLE drafting for the generation loop: autoregressive on features, with the draft's own KV cache.

Bookkeeping (cur = tokens in the target's cache, the root x_cur is the last accepted token):

* The draft's cache holds one *committed* entry per position t < cur, computed from the pair
  (f_t, x_{t+1}) with the target's true feature f_t. Pairs whose token or feature was not known yet
  are *pending*: after the prefill, (f_0, x_1) … (f_{cur-1}, root); after a step, the accepted path's
  features with their successors, ending with the target's own next token (the new root).
* ``propose`` first commits the pending pairs in one forward; its last output h_cur (the predicted
  f_cur) gives the depth-1 candidates. Expanding a depth-d node c feeds (h of c's parent, c) at
  position cur+d-1; these tree entries attend to the committed cache plus their own ancestors.
* After building the tree the cache is cropped back to the committed entries: tree entries used
  predicted features, and the accepted tokens are re-committed with the target's real features on
  the next call (what EAGLE does). So the draft's cache always equals a fresh prefill of the accepted
  sequence — tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from draftheads.eval.draft_cache import DraftKVCache
from draftheads.eval.draft_logits import ScreenedTopK, screening_available
from draftheads.eval.generate import DraftTree
from draftheads.eval.trees import StaticTree, ancestor_mask, chain, default_tree, dynamic_tree, static_tree
from draftheads.heads.eagle import EagleDraft
from draftheads.heads.target import FrozenTarget

TREE_KINDS = ("dynamic", "static", "chain")


@dataclass
class EagleTreeConfig:
    """How the EAGLE drafter shapes its tree (mirrors conf/tree/default.yaml)."""

    kind: str = "dynamic"  # dynamic (EAGLE-2) | static (rank paths) | chain (top-1 only)
    top_k: int = 10  # dynamic: children per expanded node and nodes expanded per depth
    depth: int = 6  # dynamic/chain/generic static: maximum draft depth
    nodes: int = 60  # dynamic/generic static: drafted nodes kept (the target verifies nodes + 1 tokens)
    paths: Any = None  # static: custom rank paths, e.g. [[0], [1], [0, 0]]

    @classmethod
    def from_any(cls, cfg: Any) -> "EagleTreeConfig":
        cfg = cfg or {}
        kind = cfg.get("kind") or "auto"
        kind = "dynamic" if kind == "auto" else kind
        if kind not in TREE_KINDS:
            raise ValueError(f"tree.kind must be auto, {', '.join(TREE_KINDS)} for EAGLE, got {kind!r}")
        from draftheads.heads.job import config_int  # null = the default; 0 is an error, not the default

        out = cls(kind=kind, top_k=config_int(cfg, "top_k", 10, 1, "tree"),
                  depth=config_int(cfg, "depth", 6, 1, "tree"), nodes=config_int(cfg, "nodes", 60, 1, "tree"),
                  paths=cfg.get("paths"))
        if min(out.top_k, out.depth, out.nodes) < 1:
            raise ValueError(f"tree.top_k, tree.depth and tree.nodes must be >= 1, got {out.top_k}, {out.depth}, "
                             f"{out.nodes}")
        return out

    def static(self) -> StaticTree:
        if self.kind == "chain":
            return chain(self.depth)
        if self.paths:
            return static_tree(self.paths)
        return default_tree(self.depth, self.nodes + 1)


class EagleDrafter:
    """Drafter protocol (eval.generate) for an EAGLE draft; dynamic (EAGLE-2) or static trees.

    Per step: one forward commits the pending pairs, then one batched forward per depth expands that
    depth's frontier (masks, features and positions built with tensor ops over tree *entries*, not
    per-node loops); logits are computed only for the nodes whose children are asked for. Keys and
    values live in a preallocated :class:`eval.draft_cache.DraftKVCache`; dropping the tree entries
    after a step is a length reset.
    """

    def __init__(self, draft: EagleDraft, tree: EagleTreeConfig | None = None, dtype: torch.dtype | None = None,
                 screen: bool | None = None):
        """``screen``: int8-screened top-k over the vocabulary (eval.draft_logits); None = where it pays
        (bf16/fp16 on a CPU), so fp32 drafts keep the exact logits."""
        self.draft = draft.eval()
        if dtype is not None:
            self.draft.cast(dtype)
        w = self._lm_weight()
        self._screen = ScreenedTopK(w) if (screening_available(w) if screen is None else screen) else None
        self.tree_cfg = tree or EagleTreeConfig()
        self.static = None if self.tree_cfg.kind == "dynamic" else self.tree_cfg.static()
        self.layers = self._feature_layers(draft)  # what generate() must hand us from the target
        self.feature_layer = self.layers[0]
        self.cache: DraftKVCache | None = None
        self.committed = 0  # committed entries in self.cache (= positions 0..committed-1)
        self._pend_f: torch.Tensor | None = None  # [m, H] pending features
        self._pend_x: torch.Tensor | None = None  # [m-1] pending next tokens (the root completes them)
        self._h: dict[int, torch.Tensor] = {}  # node/candidate id -> draft output after it [H] (this step)
        self._entry: dict[int, int] = {}  # node/candidate id -> index of its tree entry (0 = first after committed)
        self._hs: torch.Tensor | None = None  # [1 + entries, H]: row 0 = root output, row e+1 = tree entry e's output
        self._anc: torch.Tensor | None = None  # [cap, cap] bool: tree entry i may attend to tree entry j
        self._cand: tuple[list[int], list[int], list[int]] = ([], [], [])  # dynamic candidates: tokens, parents, depths

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    # ------------------------------------------------------------------ protocol
    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.cache = self._new_cache(int(prompt_ids.numel()))
        self.committed = 0
        self._pend_f = self._features(hidden)  # [T, H]
        self._pend_x = prompt_ids.view(-1)[1:].to(self.device)  # [T-1]

    @torch.no_grad()
    def propose(self, root: int, sampling: Any, generator: Any) -> DraftTree:
        h_root = self._commit(root)  # [H] predicted f_cur
        self._start_tree(h_root)
        if self.static is None:
            c = self.tree_cfg
            t = dynamic_tree(root, self._children, c.top_k, c.depth, c.nodes)
            tokens, parents, depths = t.tokens, t.parents, t.depths
        else:
            tokens, parents, depths = self._static_tree(root)
        self._rollback()  # drop the tree entries: only real features stay committed
        return DraftTree(tokens.cpu(), parents.cpu(), None, depths.cpu(), ancestor_mask(parents.cpu()))

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: dict[int, torch.Tensor]) -> None:
        self._pend_f = self._features(hidden)  # [len(path), H] target features at root + accepted nodes
        self._pend_x = tree.tokens[list(path[1:])].to(self.device)  # [len(path)-1]; next_token becomes the root

    # ------------------------------------------------------------------ hooks (EAGLE-3 overrides them)
    @staticmethod
    def _feature_layers(draft: Any) -> tuple[int, ...]:
        """Target hidden-state layers the draft reads."""
        return (draft.config.resolved_layer,)

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """[m, H] draft input features from the target's hidden states {layer: [m, H]}."""
        return hidden[self.feature_layer]

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft output ids -> target token ids (identity: EAGLE drafts over the target's vocabulary)."""
        return ids

    def _lm_weight(self) -> torch.Tensor:
        """[V, H] the output projection the draft's logits come from (the target's frozen lm_head)."""
        return self.draft._lm_head.weight

    def _lm_input(self, h: torch.Tensor) -> torch.Tensor:
        """[F, H] draft outputs -> what the output projection reads (EagleDraft.logits without the projection)."""
        h = h.to(self._lm_weight().dtype)
        return h if self.draft._final_norm is None else self.draft._final_norm(h)

    # ------------------------------------------------------------------ internals
    def _new_cache(self, prompt_len: int) -> Any:
        """The draft's KV cache: preallocated, appended to by the layer's ``update`` and rolled back by ``_rollback``."""
        return DraftKVCache(capacity=max(512, 2 * prompt_len))

    def _rollback(self) -> None:
        """Forget this step's tree entries: the cache keeps the ``committed`` entries only."""
        assert self.cache is not None
        self.cache.crop(self.committed)

    def _commit(self, root: int) -> torch.Tensor:
        """Run the pending pairs (true features) into the cache; return the last output [H]."""
        assert self._pend_f is not None and self._pend_x is not None, "begin() was not called"
        assert self.cache is not None
        x = torch.cat([self._pend_x, torch.tensor([root], device=self.device)])  # [m]
        f = self._pend_f.to(self.device)  # [m, H]
        m, c = x.numel(), self.committed
        assert f.shape[0] == m, (f.shape, m)
        allowed = torch.ones(m, c + m, dtype=torch.bool, device=self.device)
        allowed[:, c:] = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        pos = torch.arange(c, c + m, device=self.device)
        h = self.draft(f[None], x[None], pos[None], allowed[None], self.cache)[0]  # [m, H]
        self.committed += m
        self._pend_f = self._pend_x = None
        return h[-1]

    def _start_tree(self, h_root: torch.Tensor) -> None:
        """Fresh per-step tree state: no tree entries yet, the root's output in row 0."""
        cap = self._max_entries()
        self._h, self._entry = {0: h_root}, {}
        self._hs = h_root.new_empty(cap + 1, h_root.shape[-1])  # [1 + cap, H]
        self._hs[0] = h_root
        if self._anc is None or self._anc.shape[0] < cap:
            self._anc = torch.zeros(cap, cap, dtype=torch.bool, device=self.device)
        else:
            self._anc.zero_()

    def _max_entries(self) -> int:
        """Most tree entries one step can write: every expanded (non-leaf) node once."""
        if self.static is not None:
            return self.static.size
        c = self.tree_cfg
        return max(1, (c.depth - 1) * c.top_k)

    def _expand(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> None:
        """One draft forward over ``nodes`` (depth >= 1): each reads (h of its parent, its token).

        Node n's tree entry may attend to every committed entry, its ancestors' entries and itself; the
        root's own pair is the last committed entry. Rows of ``_anc`` hold those ancestor sets."""
        assert self.cache is not None and self._hs is not None and self._anc is not None
        dev, c = self.device, self.committed
        base = len(self._entry)  # tree entries before this forward
        F = len(nodes)
        if base + F > self._anc.shape[0]:  # an unusual tree: grow the per-step tables
            cap = 2 * (base + F)
            anc = torch.zeros(cap, cap, dtype=torch.bool, device=dev)
            anc[: base, : base] = self._anc[: base, : base]
            hs = self._hs.new_empty(cap + 1, self._hs.shape[-1])
            hs[: base + 1] = self._hs[: base + 1]
            self._anc, self._hs = anc, hs
        prow = torch.tensor([self._entry.get(parents[n], -1) for n in nodes], device=dev)  # [F] parent entry or -1
        ids = torch.tensor([tokens[n] for n in nodes], device=dev)  # [F]
        pos = torch.tensor([c + depths[n] - 1 for n in nodes], device=dev)  # [F]
        new = torch.arange(base, base + F, device=dev)  # [F] entries of these nodes
        rows = self._anc[prow.clamp(min=0), : base + F] & (prow >= 0)[:, None]  # [F, base+F] ancestors' entries
        rows[torch.arange(F, device=dev), new] = True
        self._anc[base: base + F, : base + F] = rows
        allowed = torch.cat([torch.ones(F, c, dtype=torch.bool, device=dev), rows], dim=1)  # [F, c+base+F]
        feats = self._hs[prow + 1]  # [F, H] parent outputs (row 0 = root)
        h = self.draft(feats[None], ids[None], pos[None], allowed[None], self.cache)[0]  # [F, H]
        self._hs[base + 1: base + F + 1] = h
        for i, n in enumerate(nodes):
            self._entry[n] = base + i
            self._h[n] = h[i]

    def _rows(self, nodes: list[int]) -> torch.Tensor:
        """[F, H] draft outputs after ``nodes`` (each already expanded, or the root)."""
        assert self._hs is not None
        idx = [0 if n == 0 else self._entry[n] + 1 for n in nodes]
        return self._hs[torch.tensor(idx, device=self.device)]

    def _topk(self, nodes: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(target ids [F, k], log-probs [F, k]) of the best next tokens after each of ``nodes``, best first."""
        h = self._rows(nodes)  # [F, H]
        if self._screen is not None:
            ids, lp = self._screen.topk(self._lm_input(h), k)
        else:
            logp = torch.log_softmax(self.draft.logits(h).float(), dim=-1)  # [F, V]
            lp, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return self._to_target(ids), lp

    def _children(self, frontier: list[int], tokens: list[int], parents: list[int], depths: list[int],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        self._cand = (tokens, parents, depths)  # the growing candidate lists (kept for tests/inspection)
        todo = [n for n in frontier if n not in self._h]
        if todo:
            self._expand(todo, tokens, parents, depths)
        ids, lp = self._topk(frontier, self.tree_cfg.top_k)
        return ids.cpu(), lp.cpu()

    def _static_tree(self, root: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fill a static topology: node (depth d, rank r) = rank-r token of its parent's draft distribution."""
        st = self.static
        assert st is not None
        par, dep, rank = st.parents.tolist(), st.depths.tolist(), st.ranks.tolist()
        tokens = [int(root)] + [0] * (len(par) - 1)
        for d in range(1, st.max_depth + 1):
            level = [i for i in range(len(par)) if dep[i] == d]
            ps = sorted({par[i] for i in level})
            todo = [p for p in ps if p not in self._h]
            if todo:
                self._expand(todo, tokens, par, dep)
            need = max(rank[i] for i in level) + 1
            top = self._topk(ps, need)[0].tolist()  # [P, need]
            row = {p: j for j, p in enumerate(ps)}
            for i in level:
                tokens[i] = top[row[par[i]]][rank[i]]
        return torch.tensor(tokens), st.parents, st.depths


def build_eagle_drafter(target: FrozenTarget, head: str | None, tree_cfg: Any, dtype: torch.dtype,
                        allow_target_mismatch: bool = False) -> tuple[EagleDrafter, dict[str, Any]]:
    """Load an EAGLE checkpoint for ``target`` and wrap it with the configured tree."""
    if not head:
        raise ValueError("drafter=eagle needs checkpoint=<head dir>")
    draft = EagleDraft.from_pretrained(head, target, allow_target_mismatch).to(target.device)
    tc = EagleTreeConfig.from_any(tree_cfg)
    drafter = EagleDrafter(draft, tc, dtype)
    if drafter.static is not None:
        desc = {"tree_kind": tc.kind, "tree_size": drafter.static.size, "tree_depth": drafter.static.max_depth}
    else:
        desc = {"tree_kind": "dynamic", "tree_size": tc.nodes + 1, "tree_depth": tc.depth, "tree_top_k": tc.top_k}
    return drafter, {"drafter": "eagle", "head": head, **desc}
