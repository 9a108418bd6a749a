"""EAGLE-2 dynamic draft trees, shared by every drafter that can score a node's children (EAGLE, LM).

Per depth, expand the `width` frontier nodes with the highest cumulative draft probability; each expanded
node draws `width` children. Then rerank every candidate and keep the global top `nodes`.

Losslessness under sampling needs each node's children in the tree to be a *prefix* of its draws (drawn
without replacement, in draw order). So candidates are ranked by an effective score that never exceeds the
parent's or an earlier sibling's: the kept set is then closed under parents and earlier siblings. Under greedy
drawing (top-k, draw order = probability order) the effective score is the plain cumulative log-probability.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from runtime.drafters.shared.draft_head import DraftHead
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.sampling import SamplingParams, warp
from runtime.speculation.tree import DraftTree
from runtime.speculation.verify import draw_children

# expand(candidates, node_ids) -> [len(node_ids), V] warped draft probabilities of each node's children. The
# drafter runs its model on those nodes (tokens, parents and depths are in the `Candidates` it is handed).
# V is the draft vocabulary; `token_ids` (grow_tree) maps its indices to target tokens when it is reduced.
Expand = Callable[["Candidates", list[int]], torch.Tensor]


def tree_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Draft probabilities that rank and draw a node's children. Under sampling they must be the warped q the
    verifier divides by; under greedy verification q is never read, and the warp would collapse to a one-hot
    (a chain), so the plain softmax ranks the alternatives instead."""
    return logits.float().softmax(-1) if params.greedy else warp(logits, params)


class Candidates:
    def __init__(self, token_ids: torch.Tensor | None = None):
        # target token of each draft-vocabulary index; None: the distributions are over the target vocabulary.
        # Ranking and drawing in the draft vocabulary skips a scatter and a top-k over the full one per node.
        self.token_ids = None if token_ids is None else token_ids.tolist()
        self.tokens: list[int] = []  # target token ids
        self.parents: list[int] = []
        self.logp: list[float] = []  # cumulative log draft probability
        self.eff: list[float] = []  # effective score (see module docstring)
        self.q_rows: dict[int, torch.Tensor] = {}  # row (0 = root, i+1 = node i) -> distribution of its children

    def depth(self, node: int) -> int:
        d = 0
        while node >= 0:
            node, d = self.parents[node], d + 1
        return d

    def add_children(self, row: int, probs: torch.Tensor, k: int, params: SamplingParams, generator) -> list[int]:
        self.q_rows[row] = probs
        parent = row - 1
        base_logp = self.logp[parent] if parent >= 0 else 0.0
        ceiling = self.eff[parent] if parent >= 0 else 0.0
        new = []
        drawn = draw_children(probs, k, params, generator)
        for index, p in zip(drawn.tolist(), probs[drawn].tolist()):  # two host reads, not one per child (GPU)
            if p <= 0:
                break
            score = base_logp + math.log(p)
            ceiling = min(ceiling, score)
            self.tokens.append(index if self.token_ids is None else self.token_ids[index])
            self.parents.append(parent)
            self.logp.append(score)
            self.eff.append(ceiling)
            new.append(len(self.tokens) - 1)
        return new


# expand_rows(requests) -> for each request (row, candidates, node_ids), [len(node_ids), V] as Expand returns: the
# nodes every row of a batch expands at one depth, for a drafter that runs them in one forward
ExpandRows = Callable[[list[tuple[int, "Candidates", list[int]]]], list[torch.Tensor]]


def grow_tree(root_probs: torch.Tensor, expand: Expand, budget: DraftBudget, params: SamplingParams,
              generator: torch.Generator | None = None, keep_q: bool = False,
              vocab: DraftHead | None = None) -> DraftTree:
    """`vocab`: the head whose (possibly reduced) vocabulary root_probs and expand's rows are over; None: the
    target vocabulary."""
    return grow_trees([root_probs], lambda requests: [expand(c, nodes) for _, c, nodes in requests], [budget],
                      [params], [generator], [keep_q], vocab)[0]


def grow_trees(roots: list[torch.Tensor], expand: ExpandRows, budgets: list[DraftBudget],
               params: list[SamplingParams], generators: list[torch.Generator | None], keep_q: list[bool],
               vocab: DraftHead | None = None) -> list[DraftTree]:
    """grow_tree for several rows at once, depth by depth: at each depth `expand` gets every row's nodes to expand
    (rows whose tree is done are left out), so a drafter can run them in one forward. Row i's tree, its draws and
    its order are those grow_tree makes of roots[i] with budgets[i], params[i] and generators[i]."""
    token_ids = None if vocab is None else vocab.keep_ids
    rows = [Candidates(token_ids) for _ in roots]
    frontiers = [c.add_children(0, root, b.width, p, g)
                 for c, root, b, p, g in zip(rows, roots, budgets, params, generators)]
    for level in range(1, max(b.depth for b in budgets)):
        requests = [(i, c, sorted(f, key=lambda n: (-c.eff[n], n))[: budgets[i].width])
                    for i, (c, f) in enumerate(zip(rows, frontiers)) if f and level < budgets[i].depth]
        if not requests:
            break
        for (i, c, chosen), probs in zip(requests, expand(requests)):
            frontiers[i] = []
            for node, p in zip(chosen, probs):
                frontiers[i] += c.add_children(node + 1, p, budgets[i].width, params[i], generators[i])
    return [_kept_tree(c, b, root, q, vocab) for c, b, root, q in zip(rows, budgets, roots, keep_q)]


def _kept_tree(c: "Candidates", budget: DraftBudget, root_probs: torch.Tensor, keep_q: bool,
               vocab: DraftHead | None) -> DraftTree:
    """The global top `nodes` of a row's candidates, parents before children (and q, where kept)."""
    limit = budget.nodes or budget.depth * budget.width
    keep = sorted(sorted(range(len(c.tokens)), key=lambda i: (-c.eff[i], i))[:limit])
    index = {old: new for new, old in enumerate(keep)}
    device = root_probs.device
    q = None
    if keep_q:  # only sampling verification reads q; skip the [N+1, V] tensor under greedy
        q = torch.zeros(len(keep) + 1, root_probs.numel(), dtype=root_probs.dtype, device=device)
        for row, probs in c.q_rows.items():
            node = row - 1
            if node < 0:
                q[0] = probs
            elif node in index:
                q[index[node] + 1] = probs
        if vocab is not None:
            q = vocab.to_target(q)
    parents = [index[c.parents[i]] if c.parents[i] >= 0 else -1 for i in keep]
    return DraftTree.from_lists([c.tokens[i] for i in keep], parents, [c.eff[i] for i in keep], device, q)


class TreeSlots:
    """Where a drafter keeps the KV of the nodes it expands during one propose(): slots right after its
    committed prefix, in expansion order. Each expanded node attends to the prefix, its ancestors and itself."""

    def __init__(self, prefix_len: int, root_position: int, device: torch.device | str = "cpu"):
        self.prefix = prefix_len
        self.root_position = root_position
        self.slot: dict[int, int] = {}  # node -> cache slot
        self.device = device

    def place(self, c: Candidates, nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Assign slots to `nodes`; return (slots [1, T], positions [1, T], mask [1, 1, T, n_live])."""
        for n in nodes:
            self.slot[n] = self.prefix + len(self.slot)
        n_live = self.prefix + len(self.slot)
        mask = torch.zeros(len(nodes), n_live, dtype=torch.bool)
        mask[:, : self.prefix] = True
        for row, n in enumerate(nodes):
            a = n
            while a >= 0:
                mask[row, self.slot[a]] = True
                a = c.parents[a]
        slots = torch.tensor([[self.slot[n] for n in nodes]], device=self.device)
        positions = torch.tensor([[self.root_position + c.depth(n) for n in nodes]], device=self.device)
        return slots, positions, mask.to(self.device)[None, None]
