"""EAGLE drafting for a batch: every row's committed pairs in one causal forward, then at each depth every row's
expanded nodes in one forward (runtime.speculation.dynamic_tree.grow_trees), instead of one forward per row and depth.

Row b's cache, slots, positions and masks are what EagleDrafter uses for that sequence alone (its pairs after its
own committed length, its expanded nodes where TreeSlots puts them), so a row's tree is the one EagleDrafter
proposes. Rows are padded to the batch's longest: a padding query sees only its own slot, which lies past every
slot the row's tree can take, so nothing real reads it and it overwrites nothing real.
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import BatchDrafter
from runtime.speculation.dynamic_tree import Candidates, TreeSlots, grow_trees, tree_probs
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.attention import attention_mask


class BatchEagle(BatchDrafter):
    needs_features = True

    def __init__(self, model, rows: int, max_len: int):
        """`model`: an EagleModel (runtime.drafters.eagle), already packed for the CPU; `max_len`: a row's most
        drafter positions, tree included (EagleDrafter's)."""
        self.model, self.max_len = model, max_len
        self.vocab_size = model.head.vocab_size
        self.feature_layers = model.aux_layers
        self.cache = model.new_cache(rows, 2 * max_len)  # the upper half: room for a padded row's scratch slots
        self.pending: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(rows)]
        self.cached = [0] * rows  # pairs in each row's cache, on the host

    def reset(self, row: int, tokens: Tensor, features: Tensor | None) -> None:
        if features is None or features.shape[0] != tokens.numel() - 1:
            raise ValueError("BatchEagle.reset needs one target feature per token but the last")
        self.cache.lengths[row] = 0
        self.cached[row] = 0
        self.pending[row] = [(tokens[1:], features)]

    def commit(self, rows: list[int], tokens: list[Tensor], features: list[Tensor | None]) -> None:
        for r, t, f in zip(rows, tokens, features):
            if f is None or f.shape[0] != t.numel():
                raise ValueError("BatchEagle.commit needs one target feature per committed token")
            self.pending[r].append((t, f))

    def move(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.pending[dst], self.pending[src] = self.pending[src], []
        self.cached[dst], self.cached[src] = self.cached[src], 0

    @torch.inference_mode()
    def propose(self, rows: list[int], budgets: list[DraftBudget], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[DraftTree]:
        m, head = self.model, self.model.head
        device = m.fc.weight.device
        n_rows = max(rows) + 1
        view = self.cache.rows_view(0, n_rows)
        roots = self._causal(rows, view)
        # where each row's tree may put nodes, and past them its padding (EagleDrafter's TreeSlots per row)
        trees = {r: TreeSlots(prefix_len=self.cached[r], root_position=self.cached[r], device=device) for r in rows}
        scratch = [self.cached[r] + (b.depth - 1) * b.width if r in trees else self.cached[r]
                   for r, b in zip(range(n_rows), self._budget_by_row(rows, budgets, n_rows))]
        features = {r: {0: roots[i]} for i, r in enumerate(rows)}

        def expand(requests: list[tuple[int, Candidates, list[int]]]) -> list[Tensor]:
            width = max(len(nodes) for _, _, nodes in requests)
            tokens = torch.zeros(n_rows, width, dtype=torch.long)
            slots = torch.tensor([[scratch[r] + j for j in range(width)] for r in range(n_rows)])
            positions = torch.tensor([[self.cached[r]] * width for r in range(n_rows)])
            parent = torch.zeros(n_rows, width, m.cfg.dim, dtype=roots.dtype, device=device)
            placed = []
            for i, c, nodes in requests:
                r, k = rows[i], len(nodes)
                s, pos, _ = trees[r].place(c, nodes)
                tokens[r, :k] = torch.tensor([c.tokens[n] for n in nodes])
                slots[r, :k], positions[r, :k] = s[0].cpu(), pos[0].cpu()
                parent[r, :k] = torch.stack([features[r][c.parents[n] + 1] for n in nodes])
                placed.append((r, c, nodes))
            n_live = int(slots.max()) + 1
            mask = torch.zeros(n_rows, 1, width, n_live, dtype=torch.bool)
            mask[torch.arange(n_rows)[:, None], 0, torch.arange(width)[None, :], slots] = True  # itself
            for r, c, nodes in placed:
                mask[r, 0, :len(nodes), :self.cached[r]] = True  # the committed prefix
                for j, node in enumerate(nodes):
                    a = c.parents[node]
                    while a >= 0:  # its expanded ancestors
                        mask[r, 0, j, trees[r].slot[a]] = True
                        a = c.parents[a]
            out = m.step(tokens.to(device), parent, positions.to(device), view, slots.to(device), n_live,
                         mask.to(device))[0]
            probs = []
            for r, c, nodes in placed:
                for j, node in enumerate(nodes):
                    features[r][node + 1] = out[r, j]
                probs.append(tree_probs(head(out[r, :len(nodes)]), params[rows.index(r)]))
            return probs

        return grow_trees([tree_probs(head(roots[i]), p) for i, p in enumerate(params)], expand, budgets, params,
                          generators, [not p.greedy for p in params], vocab=head)

    def _causal(self, rows: list[int], view) -> Tensor:
        """Write the drafting rows' pending pairs after their committed ones (causal among themselves), advance
        their lengths; return the feature each row's last pair predicted (its root's), [len(rows), H]."""
        m, device = self.model, self.model.fc.weight.device
        n_rows = view.batch
        pairs = {r: (torch.cat([t for t, _ in self.pending[r]]).long(), torch.cat([f for _, f in self.pending[r]]))
                 for r in rows}
        T = max(t.numel() for t, _ in pairs.values())
        if max(self.cached[r] for r in range(n_rows)) + T > self.max_len:
            raise ValueError(f"BatchEagle: {T} pairs exceed a row's {self.max_len} drafter positions")
        tokens = torch.zeros(n_rows, T, dtype=torch.long, device=device)
        features = torch.zeros(n_rows, T, m.feature_dim, dtype=m.fc.weight.dtype, device=device)
        lengths = torch.zeros(n_rows, dtype=torch.long)
        for r, (t, f) in pairs.items():
            tokens[r, :t.numel()], features[r, :t.numel()], lengths[r] = t, f, t.numel()
            self.pending[r] = []
        tree = torch.ones(T, T, dtype=torch.bool).tril()
        own = torch.arange(T)[None, :] < lengths[:, None]  # [R, T]: real pairs, then padding
        tree_mask = (tree[None] & own[:, None, :] & own[:, :, None]) | torch.eye(T, dtype=torch.bool)[None]
        cached = torch.tensor(self.cached[:n_rows])
        positions = (cached[:, None] + 1 + torch.arange(T)).clamp(max=m.rope_cos.shape[0] - 1).to(device)
        slots = view.lengths[:, None] + torch.arange(T, device=device)
        n_live = int(cached.max()) + T
        mask = attention_mask(view.lengths, positions, n_live, tree_mask.to(device))
        out = m.step(tokens, features, positions, view, slots, n_live, mask)[0]
        view.lengths += lengths.to(device)
        for r in rows:
            self.cached[r] += int(lengths[r])
        return torch.stack([out[r, int(lengths[r]) - 1] for r in rows])

    @staticmethod
    def _budget_by_row(rows: list[int], budgets: list[DraftBudget], n_rows: int) -> list[DraftBudget]:
        by_row = dict(zip(rows, budgets))
        return [by_row.get(r, DraftBudget(1)) for r in range(n_rows)]
