"""A prompt-lookup branch merged into a trained head's tree: copying is free, the head covers the rest.

Why: on a small target a draft forward is a noticeable share of a target forward, and a head's deeper guesses
are weak, while text that repeats (code, lists, names, quoted questions) is copied by prompt lookup at no draft
cost. Each step the head drafts its tree as usual and the lookup continuation (prompt + generated text, the
longest n-gram match) joins it as one more branch from the root: where the head already drafted the chain's
first tokens the branch shares those nodes, so it extends the head's guess instead of competing with it. The
target verifies the merged tree like any other: greedy output stays token-identical to plain decoding, and the
sampled rules stay exact because both drafters pick children deterministically (no draft probabilities).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from draftheads.eval.baselines import PromptLookupDrafter
from draftheads.eval.generate import DraftTree, first_choice_chain
from draftheads.eval.trees import ancestor_mask, depths_of


def merge_chain(tokens: torch.Tensor, parents: torch.Tensor, chain: Sequence[int],
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Hang ``chain`` under the root of a tree, sharing every prefix node the tree already has.

    tokens [N], parents [N] (parents[0] = -1, parents before children) -> (tokens [M], parents [M], the
    chain's node indices [len(chain)]); M - N = chain tokens not already drafted at that place. No sibling
    pair carries the same token afterwards, so a rejected token is never tried twice."""
    toks, par = tokens.tolist(), parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(par)):
        children.setdefault(par[i], {}).setdefault(toks[i], i)
    node, nodes = 0, []
    for t in chain:
        nxt = children.get(node, {}).get(int(t))
        if nxt is None:
            toks.append(int(t))
            par.append(node)
            nxt = len(toks) - 1
            children.setdefault(node, {})[int(t)] = nxt
        nodes.append(nxt)
        node = nxt
    return torch.tensor(toks, dtype=tokens.dtype), torch.tensor(par, dtype=parents.dtype), nodes


class LookupBranch:
    """Drafter protocol (eval.generate): ``inner``'s tree plus ``lookup``'s proposal (prompt lookup) per step.

    The inner drafter is told about every accepted path (a path may run along the lookup branch: EAGLE's and
    Medusa's ``accept`` read only the accepted tokens and the target's hidden states there)."""

    def __init__(self, inner: Any, lookup: PromptLookupDrafter):
        self.inner = inner
        self.lookup = lookup  # its num_tokens caps the branch
        self.layers = tuple(getattr(inner, "layers", ()))
        self.merged_nodes = 0  # lookup nodes the head had not drafted, summed over steps (reports)

    def __getattr__(self, name: str) -> Any:  # the inner drafter's attributes (draft, tree_cfg, ...) for reports
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def begin(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.inner.begin(prompt_ids, hidden)
        self.lookup.begin(prompt_ids, hidden)

    @torch.no_grad()
    def propose(self, root: int, sampling: Any, generator: Any) -> DraftTree:
        tree = self.inner.propose(root, sampling, generator)
        self.lookup.extend([root])
        chain = self.lookup.lookup()
        if not chain or tree.draft_probs is not None:  # sampled drafts carry q; lookup nodes have none to give
            return tree
        n0 = int(tree.tokens.numel())
        tokens, parents, nodes = merge_chain(tree.tokens, tree.parents, chain)
        self.merged_nodes += int(tokens.numel()) - n0
        # rows verification is likeliest to read: the head's first choices and the copied chain
        prefetch = sorted(set(first_choice_chain(parents)) | set(nodes))
        return DraftTree(tokens, parents, None, depths_of(parents), ancestor_mask(parents), prefetch)

    def accept(self, tree: DraftTree, path: Sequence[int], next_token: int, hidden: dict[int, torch.Tensor]) -> None:
        self.inner.accept(tree, path, next_token, hidden)
        self.lookup.extend(tree.tokens[list(path[1:])].tolist())  # the root is known; next_token is the next root
