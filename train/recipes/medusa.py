"""Medusa: head k matches the target's distribution k+1 tokens after the root."""
from __future__ import annotations

from torch import Tensor

from runtime.drafters.medusa import MedusaConfig, MedusaHeads
from runtime.drafters.shared.draft_head import DraftHead
from runtime.target.model import Transformer
from train.losses import soft_cross_entropy
from train.recipes import LossFn, Recipe
from train.target_outputs import target_features, top1


def medusa_loss(target: Transformer, decay: float = 0.8) -> LossFn:
    """Medusa: head k on feature f_t matches the target's distribution for token t+k+2 (the target's own
    f_{t+k+1}), weighted decay**k because deeper heads matter less (fewer drafts reach them)."""

    def loss_fn(model: MedusaHeads, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch)
        f = t.features
        T = f.shape[1]
        total, metrics = 0.0, {}
        logits_all = model(f)  # [B, T, K, Vd]
        for k in range(model.cfg.num_heads):
            span = T - k - 2
            if span <= 0:
                break
            logits = logits_all[:, :span, k]
            goal = model.head(f[:, k + 1: k + 1 + span])
            m = t.mask[:, k + 2: k + 2 + span]
            loss = soft_cross_entropy(goal, logits, m)
            total = total + decay ** k * loss
            metrics[f"head{k}_top1"] = top1(logits, goal, m)
        return total, metrics

    return loss_fn


def build_medusa(target: Transformer, num_heads: int, keep_ids: Tensor | None) -> MedusaHeads:
    head = DraftHead(target.output, keep_ids)
    cfg = MedusaConfig(hidden_size=target.config.dim, num_heads=num_heads)
    return MedusaHeads(cfg, head).to(target.dtype).requires_grad_(True).train()


class MedusaRecipe(Recipe):
    def build(self, target, drafter, distill, keep_ids):
        return build_medusa(target, drafter.medusa_heads, keep_ids)

    def loss(self, target, drafter, distill, keep_ids):
        return medusa_loss(target)


RECIPE = MedusaRecipe()
