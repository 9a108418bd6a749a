"""Distillation losses checked against direct formulas and torch's own implementations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.losses import (cross_entropy, feature_regression, kl_divergence, masked_mean, medusa_cross_entropy,
                          soft_cross_entropy, topk_accuracy, total_variation)

B, T, V = 3, 7, 11


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    target = 2 * torch.randn(B, T, V, generator=g)
    draft = 2 * torch.randn(B, T, V, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, 0] = True
    return target, draft, mask


def test_kl_matches_torch_and_is_zero_only_for_equal_distributions(logits):
    target, draft, mask = logits
    ref = F.kl_div(draft.log_softmax(-1), target.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl_divergence(target, draft, mask), ref[mask].mean())
    assert kl_divergence(target, draft, mask) > 0
    assert kl_divergence(target, target, mask).abs() < 1e-6
    assert kl_divergence(target, target + 5.0, mask).abs() < 1e-6  # logits shift: same distribution


def test_kl_ignores_zero_probability_tokens():
    target = torch.tensor([[0.0, 1.0, -torch.inf, 2.0]])  # token 2 impossible under the target
    draft = torch.tensor([[0.5, 0.1, 3.0, 1.0]])
    mask = torch.tensor([True])
    p, log_q = target.softmax(-1), draft.log_softmax(-1)
    expected = sum(p[0, i] * (p[0, i].log() - log_q[0, i]) for i in (0, 1, 3))
    kl = kl_divergence(target, draft, mask)
    assert torch.isfinite(kl)
    torch.testing.assert_close(kl, expected)


def test_total_variation_range_and_formula(logits):
    target, draft, mask = logits
    tv = total_variation(target, draft, mask)
    p, q = target.softmax(-1), draft.softmax(-1)
    torch.testing.assert_close(tv, (0.5 * (p - q).abs().sum(-1))[mask].mean())
    assert 0 < tv < 1
    assert total_variation(target, target, mask).abs() < 1e-6
    disjoint = total_variation(torch.tensor([[50.0, -50.0]]), torch.tensor([[-50.0, 50.0]]), torch.tensor([True]))
    assert disjoint == pytest.approx(1.0, abs=1e-6)


def test_soft_cross_entropy_is_kl_plus_target_entropy(logits):
    target, draft, mask = logits
    p = target.softmax(-1)
    entropy = -(p * p.log()).sum(-1)[mask].mean()
    torch.testing.assert_close(soft_cross_entropy(target, draft, mask), kl_divergence(target, draft, mask) + entropy)


def test_cross_entropy_matches_torch_on_masked_positions_only(logits):
    _, draft, mask = logits
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    labels[~mask] = -5  # garbage where masked out must not matter
    ref = F.cross_entropy(draft[mask], labels[mask])
    torch.testing.assert_close(cross_entropy(draft, labels, mask), ref)


def test_feature_regression_matches_smooth_l1(logits):
    target, draft, mask = logits
    ref = F.smooth_l1_loss(draft[mask], target[mask], beta=0.5)
    torch.testing.assert_close(feature_regression(draft, target, mask, beta=0.5), ref)


def test_medusa_heads_use_shifted_labels_and_decaying_weights():
    K = 3
    g = torch.Generator().manual_seed(2)
    head_logits = torch.randn(B, T, K, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, -1] = True
    total, per_head = medusa_cross_entropy(head_logits, ids, mask, decay=0.5)
    expected = 0.0
    for k in range(K):
        m = mask[:, k + 2:]
        ce = F.cross_entropy(head_logits[:, : T - k - 2, k][m], ids[:, k + 2:][m])
        torch.testing.assert_close(per_head[k], ce)
        expected = expected + 0.5 ** k * ce
    torch.testing.assert_close(total, expected)
    short_total, short = medusa_cross_entropy(head_logits[:, :3], ids[:, :3], mask[:, :3])
    assert short[1] == 0 and short[2] == 0 and short_total == short[0]  # only head 0 fits in 3 tokens


def test_topk_accuracy_counts_masked_positions():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 0.0]]])
    labels = torch.tensor([[1, 3, 2]])  # rank 2, rank 1, rank >= 2
    mask = torch.tensor([[True, True, False]])
    acc = topk_accuracy(logits, labels, mask, ks=(1, 2, 4))
    assert acc == {1: 0.5, 2: 1.0, 4: 1.0}
    with pytest.raises(ValueError, match="ks"):
        topk_accuracy(logits, labels, mask, ks=(5,))


def test_empty_mask_gives_zero_and_bad_masks_are_rejected(logits):
    target, draft, mask = logits
    assert kl_divergence(target, draft, torch.zeros_like(mask)) == 0
    with pytest.raises(ValueError, match="mask must be bool"):
        kl_divergence(target, draft, mask.float())
    with pytest.raises(ValueError, match="same shape"):
        total_variation(target, draft[..., :-1], mask)
    with pytest.raises(ValueError, match="mask must be bool"):
        masked_mean(torch.ones(B, T), mask[:, :-1])


def test_gradient_flows_only_from_masked_positions(logits):
    target, draft, mask = logits
    draft = draft.clone().requires_grad_(True)
    kl_divergence(target, draft, mask).backward()
    assert draft.grad[~mask].abs().max() == 0
    assert draft.grad[mask].abs().max() > 0


@pytest.mark.parametrize("loss", [kl_divergence, total_variation, soft_cross_entropy])
def test_an_all_true_mask_gives_the_value_and_gradient_of_the_selected_rows(logits, loss):
    """Rows already selected (eagle_loss) skip the boolean index; the result must equal indexing them."""
    target, draft, mask = logits
    rows_t, rows_d = target[mask], draft[mask].clone().requires_grad_(True)
    padded_d = draft.clone().requires_grad_(True)
    selected = loss(rows_t, rows_d, torch.ones(len(rows_t), dtype=torch.bool))
    indexed = loss(target, padded_d, mask)
    selected.backward()
    indexed.backward()
    torch.testing.assert_close(selected, indexed)
    torch.testing.assert_close(rows_d.grad, padded_d.grad[mask])
