"""export/calibrate/layer_map.py: KL similarity, the monotone DP against brute force, LayerMap JSON, the heatmap."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from export.calibrate.layer_map import DENSE, LayerMap, kl_similarity, monotone_layer_map, plot_layer_map


def brute_force_map(S: torch.Tensor, dense_first: int) -> tuple[list[int], float]:
    """Best over every non-decreasing map (combinations with replacement are exactly those sequences)."""
    n_draft, n_target = S.shape
    best = max(itertools.combinations_with_replacement(range(n_draft), n_target - dense_first),
               key=lambda m: sum(S[i, dense_first + k].item() for k, i in enumerate(m)))
    return [DENSE] * dense_first + list(best), sum(S[i, dense_first + k].item() for k, i in enumerate(best))


def score(S: torch.Tensor, mapping: list[int]) -> float:
    return sum(S[m, j].item() for j, m in enumerate(mapping) if m != DENSE)


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force_and_is_monotone(seed):
    g = torch.Generator().manual_seed(seed)
    for n_draft, n_target in [(1, 4), (2, 5), (3, 6), (4, 7)]:
        S = torch.randn(n_draft, n_target, generator=g, dtype=torch.float64)
        for dense_first in (0, 1, 3):
            mapping = monotone_layer_map(S, dense_first)
            expected, best = brute_force_map(S, dense_first)
            assert mapping == expected, (n_draft, n_target, dense_first)
            assert math.isclose(score(S, mapping), best)
            mapped = mapping[dense_first:]
            assert mapping[:dense_first] == [DENSE] * dense_first
            assert all(a <= b for a, b in zip(mapped, mapped[1:])) and all(0 <= m < n_draft for m in mapped)


def test_dp_gives_up_the_unconstrained_best_to_stay_monotone():
    S = torch.tensor([[0.0, 5.0, 0.0], [4.0, 0.0, 4.0]])  # column-wise best [1, 0, 1] (13) is not monotone
    assert monotone_layer_map(S) == [0, 0, 1]  # 9, against [1, 1, 1] = 8 and [0, 0, 0] = 5


def test_all_dense_and_bad_arguments():
    S = torch.randn(2, 3)
    assert monotone_layer_map(S, dense_first=3) == [DENSE] * 3
    with pytest.raises(ValueError, match="dense_first must be in"):
        monotone_layer_map(S, dense_first=4)
    with pytest.raises(ValueError, match="finite score matrix"):
        monotone_layer_map(torch.tensor([[0.0, float("nan")]]))


def random_attention(n_layers: int, seed: int, rows=(3, 5), keys: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(n_layers, *rows, keys, generator=g), -1)


def test_kl_similarity_matches_torch_kl_div():
    target, draft = random_attention(4, seed=0), random_attention(2, seed=1)
    S = kl_similarity(target, draft)
    assert S.shape == (2, 4)
    for i in range(2):
        for j in range(4):
            kl = torch.nn.functional.kl_div(draft[i].double().log(), target[j].double(), reduction="none")
            assert S[i, j].item() == pytest.approx(-kl.sum(-1).mean().item(), rel=1e-9, abs=1e-12)


def test_kl_similarity_is_safe_with_zero_probabilities():
    target = random_attention(2, seed=2)
    draft = target[:1].clone()
    target[0, :, :, :4] = 0  # target ignores some keys: those terms vanish
    draft[0, :, :, 4:6] = 0  # draft ignores keys the target attends to: large but finite penalty
    S = kl_similarity(target, draft)
    assert torch.isfinite(S).all() and S[0, 1] < S.new_tensor(-1.0)


def test_layer_map_recovers_a_planted_monotone_alignment():
    planted = [0, 0, 1, 1, 1, 2, 2, 2]
    g = torch.Generator().manual_seed(3)
    base = 2 * torch.randn(3, 3, 5, 12, generator=g)  # one attention pattern per draft layer
    draft = torch.softmax(base, -1)
    target = torch.softmax(base[planted] + 0.3 * torch.randn(8, 3, 5, 12, generator=g), -1)  # noisy copies
    S = kl_similarity(target, draft)
    fitted = LayerMap.fit(S, dense_first=2)
    assert list(fitted.mapping) == [DENSE, DENSE] + planted[2:]
    assert fitted.total_score == pytest.approx(score(S, list(fitted.mapping)))


def test_layer_map_json_round_trip_and_validation():
    S = torch.randn(3, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    layer_map = LayerMap.fit(S, dense_first=1)
    again = LayerMap.from_json(layer_map.to_json())
    assert again == layer_map and again.scores == tuple(map(tuple, S.tolist()))
    with pytest.raises(ValueError, match="non-decreasing"):
        LayerMap((DENSE, 2, 1, 1, 1, 1), layer_map.scores, dense_first=1)
    with pytest.raises(ValueError, match="must be dense"):
        LayerMap((0, 0, 1, 1, 1, 1), layer_map.scores, dense_first=1)
    with pytest.raises(ValueError, match="one per target layer"):
        LayerMap((0, 0), layer_map.scores)
    with pytest.raises(ValueError, match="keys mapping, scores, dense_first"):
        LayerMap.from_json('{"mapping": []}')


def test_plot_writes_a_png(tmp_path):
    S = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    mapping = monotone_layer_map(S, dense_first=2)
    path = plot_layer_map(S, mapping, tmp_path / "layer_map.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
