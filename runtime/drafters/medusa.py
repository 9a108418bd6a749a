"""Medusa drafter: K residual heads on the target's last hidden state; head k guesses the token k+1 after
the root (the root itself is the target's own next token). The heads are independent of the path, so a tree is
built best-first over products of per-depth probabilities (the same EAGLE-2 ranking, with free expansions).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from runtime.drafters.shared.draft_head import DraftHead
from runtime.speculation.draft_budget import DraftBudget
from runtime.speculation.drafter import Drafter, DrafterKind
from runtime.speculation.dynamic_tree import grow_tree, tree_probs
from runtime.speculation.sampling import SamplingParams
from runtime.speculation.tree import DraftTree
from runtime.target.cpu_packing import Linear, pack_for_cpu


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int = 4
    layers_per_head: int = 1

    def to_dict(self) -> dict:
        return {"kind": "medusa", **asdict(self)}


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as identity: head k begins as the target's own lm_head
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig, head: DraftHead):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.layers_per_head)])
            for _ in range(cfg.num_heads))
        self.head = head

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] -> logits [..., K, Vd] over the draft vocabulary."""
        return torch.stack([self.head(block(features)) for block in self.blocks], dim=-2)


class MedusaDrafter(Drafter):
    needs_features = True

    def __init__(self, heads: MedusaHeads):
        self.heads = pack_for_cpu(heads)
        self.vocab_size = heads.head.vocab_size
        self.last_feature: torch.Tensor | None = None

    def reset(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self._take(features)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self._take(features)

    def _take(self, features: torch.Tensor | None) -> None:
        if features is None or features.numel() == 0:
            raise ValueError("MedusaDrafter needs the target's hidden states (features)")
        self.last_feature = features[-1]

    @torch.inference_mode()
    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        depth = min(budget.depth, self.heads.cfg.num_heads)
        logits = self.heads(self.last_feature.to(self.heads.head.weight.dtype))  # [K, Vd]
        probs = tree_probs(logits[:depth], params)  # [depth, draft vocabulary]
        budget = DraftBudget(depth=depth, width=budget.width, nodes=budget.nodes)
        return grow_tree(probs[0], lambda c, ids: probs[[c.depth(i) for i in ids]], budget, params, generator,
                         keep_q=not params.greedy, vocab=self.heads.head)


class MedusaKind(DrafterKind):
    name = "medusa"
    module_type = MedusaHeads
    onnx_inputs, onnx_outputs = ("features",), ("logits",)

    def config(self, module, draft_vocab, settings):
        return module.cfg.to_dict()

    def module(self, config, target, max_len, keep_ids):
        cfg = MedusaConfig(**{k: v for k, v in config.items() if k != "kind"})
        return MedusaHeads(cfg, DraftHead(target.output, keep_ids))

    def drafter(self, module, config, target, max_len, keep_ids):
        return MedusaDrafter(module)

    def onnx_step(self, module):
        return module  # the heads are their own step

    def onnx_example(self, module, batch, seq, generator):
        return {"features": torch.randn(batch, seq, module.cfg.hidden_size, generator=generator)}


KIND = MedusaKind()
