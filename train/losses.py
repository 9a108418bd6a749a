"""Distillation losses over masked positions: logits [..., V] (or features [..., H]) and a bool mask [...].

Every loss is computed in float32 on the positions where `mask` is True only (selected before any softmax:
padding and prompt rows cost nothing), so they neither add to the loss nor dilute it. p is the target, q the
drafter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(mask: Tensor, shape: torch.Size, what: str) -> None:
    if mask.dtype != torch.bool or mask.shape != shape:
        raise ValueError(f"{what}: mask must be bool with shape {tuple(shape)}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask`; 0 when nothing is masked in (where() keeps inf/nan outside out)."""
    _check(mask, values.shape, "masked_mean")
    return torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)


def _masked_rows(target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Both logits [N, V] in float32 on the N masked positions."""
    if target_logits.shape != draft_logits.shape:
        raise ValueError(f"target logits {tuple(target_logits.shape)} and draft logits "
                         f"{tuple(draft_logits.shape)} must have the same shape")
    _check(mask, target_logits.shape[:-1], "distillation loss")
    if bool(mask.all()):  # rows the caller already selected (eagle_loss): a boolean index would only copy them
        return target_logits.flatten(0, -2).float(), draft_logits.flatten(0, -2).float()
    return target_logits[mask].float(), draft_logits[mask].float()


def _distributions(target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """p, log p and log q [N, V] on the N masked positions."""
    target, draft = _masked_rows(target_logits, draft_logits, mask)
    log_p = target.log_softmax(-1)
    return log_p.exp(), log_p, draft.log_softmax(-1)


def _mean(per_position: Tensor) -> Tensor:
    return per_position.sum() / max(per_position.numel(), 1)  # 0 when no position is masked in


def kl_divergence(target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> Tensor:
    """Forward KL(p || q) = sum p (log p - log q): mass-covering, what acceptance min(1, p/q) rewards."""
    p, log_p, log_q = _distributions(target_logits, draft_logits, mask)
    return _mean(torch.where(p > 0, p * (log_p - log_q), 0).sum(-1))  # 0 log 0 = 0, even where q is 0 too


def total_variation(target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> Tensor:
    """TV(p, q) = 1/2 sum |p - q| in [0, 1]; 1 - TV is the chance a sampled draft token is accepted."""
    p, _, log_q = _distributions(target_logits, draft_logits, mask)
    return _mean(0.5 * (p - log_q.exp()).abs().sum(-1))


# distill.kd_loss -> the distance an LM drafter minimises to the target's next-token distribution
KD_DISTANCES = {"forward_kl": kl_divergence, "tv": total_variation}


def soft_cross_entropy(target_logits: Tensor, draft_logits: Tensor, mask: Tensor) -> Tensor:
    """-sum p log q: KL plus the target's entropy, same gradient for q, cheaper (no log p term)."""
    target, draft = _masked_rows(target_logits, draft_logits, mask)
    return cross_entropy_to(target.softmax(-1), draft)


def cross_entropy_to(target_probs: Tensor, draft_logits: Tensor) -> Tensor:
    """soft_cross_entropy on rows already selected, from the target's probabilities [N, V] (computed once where
    several losses share them)."""
    # torch's fused soft-label cross entropy; 0 * log 0 terms are 0 as long as the draft logits are finite
    return _mean(F.cross_entropy(draft_logits.float(), target_probs, reduction="none"))


def cross_entropy(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Hard-label CE; `labels` [...] may hold anything (e.g. padding) where mask is False."""
    _check(mask, labels.shape, "cross_entropy")
    safe = torch.where(mask, labels, 0)
    per_position = F.cross_entropy(logits.float().flatten(0, -2), safe.flatten(), reduction="none")
    return masked_mean(per_position.view_as(labels), mask)


def feature_regression(pred: Tensor, target: Tensor, mask: Tensor, beta: float = 1.0) -> Tensor:
    """SmoothL1 between predicted and target features [..., H], averaged over H then masked positions (EAGLE)."""
    if pred.shape != target.shape:
        raise ValueError(f"predicted features {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    per_position = F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=beta).mean(-1)
    return masked_mean(per_position, mask)


def medusa_cross_entropy(head_logits: Tensor, input_ids: Tensor, mask: Tensor,
                         decay: float = 0.8) -> tuple[Tensor, list[Tensor]]:
    """Medusa heads [B, T, K, V]: head k at position t predicts token t + k + 2 (the base LM head predicts
    t + 1), counted where mask[t + k + 2]. Total = sum_k decay**k CE_k: deeper heads are reached less often.
    Returns the total and the per-head CE."""
    B, T, K, _ = head_logits.shape
    if input_ids.shape != (B, T):
        raise ValueError(f"input_ids {tuple(input_ids.shape)}: expected {(B, T)} to match head logits")
    _check(mask, input_ids.shape, "medusa_cross_entropy")
    total, per_head = head_logits.new_zeros((), dtype=torch.float32), []
    for k in range(K):
        span = T - k - 2
        if span <= 0:  # sequence too short for this head: it contributes nothing
            per_head.append(total.new_zeros(()))
            continue
        ce = cross_entropy(head_logits[:, :span, k], input_ids[:, k + 2:], mask[:, k + 2:])
        per_head.append(ce)
        total = total + decay ** k * ce
    return total, per_head


@torch.no_grad()
def topk_accuracy(draft_logits: Tensor, labels: Tensor, mask: Tensor, ks: tuple[int, ...] = (1,)) -> dict[int, float]:
    """Fraction of masked positions whose label is among the drafter's top-k, per k.
    For distillation pass labels = target_logits.argmax(-1)."""
    _check(mask, labels.shape, "topk_accuracy")
    if not ks or min(ks) < 1 or max(ks) > draft_logits.shape[-1]:
        raise ValueError(f"ks={ks}: expected values in 1..{draft_logits.shape[-1]} (the vocabulary)")
    if not bool(mask.all()):  # a boolean index copies even when it selects every row
        draft_logits, labels = draft_logits[mask], labels[mask]
    top = draft_logits.reshape(-1, draft_logits.shape[-1]).topk(max(ks), dim=-1).indices
    hits = (top == labels.reshape(-1, 1)).cumsum(-1).bool()  # hits[:, j]: label within the top j+1
    return {k: float(_mean(hits[:, k - 1].float())) for k in ks}
