"""kernels/dynamic_int8.py: fbgemm's int8 product against the same arithmetic in plain torch."""
import pytest
import torch

from kernels import dynamic_int8


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_product_equals_the_dequantised_reference(rows, with_bias):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 96, generator=g), torch.randn(2, rows, 96, generator=g)
    bias = torch.randn(300, generator=g) if with_bias else None
    codes, scales = dynamic_int8.quantize(w)
    y = dynamic_int8.linear(x, dynamic_int8.pack(codes, scales, bias))
    ref = dynamic_int8.reference(x, codes, scales, bias)
    assert y.shape == (2, rows, 300)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and near the fp32 product: int8 weights and activations lose about a percent
    assert (y - torch.nn.functional.linear(x, w, bias)).abs().max() <= 0.03 * ref.abs().max()


def test_codes_are_within_half_a_scale_of_the_weight():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    w[3] = 0  # an all-zero row keeps a usable scale
    codes, scales = dynamic_int8.quantize(w)
    assert codes.dtype == torch.int8 and scales.shape == (64,)
    assert ((codes.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()
    assert codes.abs().max() == 127
