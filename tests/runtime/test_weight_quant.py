"""runtime/weight_quant.py: drafter state dicts to packed codes + scales and back, within the documented bounds."""
from __future__ import annotations

import pytest
import torch

import runtime.weight_quant as weight_quant
from runtime.weight_quant import (QuantScheme, dequantize_state_dict, error_bound, quantize_state_dict, relative_errors)

SCHEMES = ["int8", "int4-g32", "int4-g64", "int4-g128"]


def drafter_state_dict(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "embed.weight": torch.randn(96, 128, generator=g),
        "layers.0.q_proj.weight": 0.05 * torch.randn(64, 128, generator=g),
        "layers.0.q_proj.bias": torch.randn(64, generator=g),
        "layers.0.mlp.down_proj.weight": torch.randn(128, 256, generator=g) * torch.rand(128, 1, generator=g),
        "layers.0.input_layernorm.weight": 1 + 0.1 * torch.randn(128, generator=g),
    }
    sd["layers.0.mlp.down_proj.weight"][3] = 0  # an all-zero output channel must come back as zeros
    return {k: v.to(dtype) for k, v in sd.items()}


@pytest.mark.parametrize("name", SCHEMES)
def test_roundtrip_error_is_within_half_a_step_per_element(name):
    scheme = QuantScheme.parse(name)
    sd = drafter_state_dict()
    packed = quantize_state_dict(sd, scheme)
    restored = dequantize_state_dict(packed, scheme)
    assert restored.keys() == sd.keys()
    for key, w in sd.items():
        if w.dim() != 2:
            assert packed[key] is w and restored[key] is w  # norms and biases pass through untouched
            continue
        codes, scales = packed[key + ".qweight"], packed[key + ".scales"]
        if scheme.bits == 8:
            assert codes.dtype == torch.int8 and codes.shape == w.shape and scales.shape == (w.shape[0],)
        else:
            assert codes.dtype == torch.uint8 and codes.shape == (w.shape[0], w.shape[1] // 2)
            assert scales.shape == (w.shape[0], w.shape[1] // scheme.group_size)
        err = (restored[key] - w).abs()
        assert (err <= error_bound(scales, scheme) * (1 + 1e-6)).all(), key
    assert torch.equal(restored["layers.0.mlp.down_proj.weight"][3], torch.zeros(256))


def test_finer_schemes_are_more_accurate():
    sd = drafter_state_dict(seed=1)
    errors = {name: relative_errors(sd, quantize_state_dict(sd, name), name) for name in SCHEMES}
    for key in errors["int8"]:
        assert [errors[name][key] for name in SCHEMES] == sorted(errors[name][key] for name in SCHEMES), key
        assert errors["int8"][key] < 0.01 and errors["int4-g128"][key] < 0.15, key  # Frobenius, relative


@pytest.mark.parametrize("name", SCHEMES)
def test_a_block_of_rows_at_a_time_gives_the_whole_matrix_bits(name, monkeypatch):
    sd = drafter_state_dict(seed=2)
    whole = quantize_state_dict(sd, name)
    whole_restored, whole_errors = dequantize_state_dict(whole, name), relative_errors(sd, whole, name)
    monkeypatch.setattr(weight_quant, "ROW_BLOCK", 7)  # no matrix's rows a multiple of it: a short last block
    blocked = quantize_state_dict(sd, name)
    assert all(torch.equal(blocked[k], whole[k]) for k in whole)
    restored = dequantize_state_dict(blocked, name)
    assert all(torch.equal(restored[k], whole_restored[k]) for k in whole_restored)
    assert relative_errors(sd, blocked, name) == pytest.approx(whole_errors, rel=1e-5)


def test_bf16_weights_quantise_and_restore_in_the_requested_dtype():
    sd = drafter_state_dict(dtype=torch.bfloat16)
    restored = dequantize_state_dict(quantize_state_dict(sd, "int4-g64"), "int4-g64", dtype=torch.bfloat16)
    assert restored["embed.weight"].dtype == torch.bfloat16
    assert max(relative_errors(sd, quantize_state_dict(sd, "int4-g64"), "int4-g64").values()) < 0.2


@pytest.mark.parametrize("name,match", [("int3", "unknown quantisation scheme"), ("int4-g48", "group size"),
                                        ("int4-gx", "unknown quantisation scheme")])
def test_bad_scheme_names_are_rejected(name, match):
    with pytest.raises(ValueError, match=match):
        QuantScheme.parse(name)


def test_scheme_names_round_trip():
    assert [QuantScheme.parse(n).name for n in SCHEMES] == SCHEMES
    with pytest.raises(ValueError, match="per output channel"):
        QuantScheme(8, 32)


def test_a_matrix_that_does_not_split_into_groups_is_named_in_the_error():
    sd = {"proj.weight": torch.randn(8, 96)}
    with pytest.raises(ValueError, match=r"proj\.weight: input dim 96 .* int4-g64"):
        quantize_state_dict(sd, "int4-g64")


def test_dequantize_reports_a_missing_scale():
    packed = quantize_state_dict({"proj.weight": torch.randn(8, 64)}, "int8")
    del packed["proj.weight.scales"]
    with pytest.raises(ValueError, match="no matching proj.weight.scales"):
        dequantize_state_dict(packed, "int8")
