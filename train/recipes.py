"""Drafter recipes: how each kind is built from the target and what it is trained to match.

Every loss reads the target's own outputs (features and next-token distributions) under a frozen forward, so
drafters learn the target's behaviour rather than the dataset's. Rows are masked to assistant tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from runtime.draft_head import DraftHead
from runtime.eagle import EagleModel
from runtime.medusa import MedusaConfig, MedusaHeads
from runtime.model import Transformer
from train.losses import feature_regression, soft_cross_entropy, topk_accuracy

LossFn = Callable[[nn.Module, dict], tuple[Tensor, dict]]


@dataclass(frozen=True)
class TargetOutputs:
    features: Tensor  # [B, T, H] last hidden after the final norm
    mask: Tensor  # [B, T] bool, assistant tokens


@torch.no_grad()
def target_features(target: Transformer, batch: dict) -> TargetOutputs:
    ids = batch["input_ids"]
    B, T = ids.shape
    """The frozen target's features: read from the batch when prepare cached them (offline), else computed."""
    if "features" in batch:
        return TargetOutputs(batch["features"].to(target.dtype), batch["loss_mask"].bool())
    cache = target.new_cache(B, T)
    positions = torch.arange(T, device=ids.device).expand(B, T)
    out = target.run(ids, cache, positions, no_logits=True)
    return TargetOutputs(out.hidden, batch["loss_mask"].bool())


def top1(draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> float:
    return topk_accuracy(draft_logits, target_logits.argmax(-1), mask)[1]


def eagle_loss(target: Transformer, noise: float = 0.1, w_feature: float = 1.0, w_token: float = 0.1) -> LossFn:
    """EAGLE: regress the next feature (SmoothL1) and match the target's next-token distribution (soft CE);
    uniform noise on input features trains the drafter to tolerate its own imperfect predictions."""

    def loss_fn(model: EagleModel, batch: dict) -> tuple[Tensor, dict]:
        t = target_features(target, batch)
        ids, f = batch["input_ids"], t.features
        B, T = ids.shape
        inputs = f[:, :-1] + noise * (2 * torch.rand_like(f[:, :-1]) - 1)
        pred = model.causal(ids[:, 1:], inputs, model.new_cache(B, T - 1))[:, :-1]  # predicts f[:, 1:T-1]
        goal, m = f[:, 1:-1], t.mask[:, 2:]  # row j predicts token j+2
        reg = feature_regression(pred, goal, m)
        logits, goal_logits = model.head(pred), model.head(goal)
        tok = soft_cross_entropy(goal_logits, logits, m)
        return w_feature * reg + w_token * tok, {"feature_loss": reg.item(), "token_loss": tok.item(),
                                                 "top1": top1(logits, goal_logits, m)}

    return loss_fn


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


def build_eagle(target: Transformer, keep_ids: Tensor | None, from_target: bool = True) -> EagleModel:
    head = DraftHead(target.output.weight, keep_ids)
    if from_target:
        model = EagleModel.from_target(target, head)
    else:
        model = EagleModel(target.config, target.tok_embeddings.weight, head, target.max_seq_len).to(target.dtype)
    return model.requires_grad_(True).train()


def build_medusa(target: Transformer, num_heads: int, keep_ids: Tensor | None) -> MedusaHeads:
    head = DraftHead(target.output.weight, keep_ids)
    cfg = MedusaConfig(hidden_size=target.config.dim, num_heads=num_heads)
    return MedusaHeads(cfg, head).to(target.dtype).requires_grad_(True).train()
