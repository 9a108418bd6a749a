"""A copy of a Transformer whose linear layers run int8 (kernels/dynamic_int8.py), built from the model in memory:
the draft of self-speculation (runtime/drafters/quantspec.py). Embedding, norms and rope tables are the original's
own tensors, shared, not copied; only the matmul weights get a second, int8 copy (a quarter of fp32's bytes).

The weights are read from the plain weight, or from our fp32 kernel's panels where a lean model keeps only those,
a slice of one layer's rows at a time, so building it holds little fp32 beyond the model.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from kernels import dynamic_int8
from runtime.target.cpu_packing import Packable
from runtime.target.model import Transformer

SCHEME = "int8"  # weights per output channel; activations quantised per call


ROWS_AT_ONCE = 8192  # a 151,936-row head quantised whole holds three fp32 copies of itself at once


def quantized_rows(layer: Packable) -> tuple[Tensor, Tensor]:
    """kernels.dynamic_int8.quantize of the layer's weight, a slice of rows at a time."""
    n = layer.weight.shape[0]
    parts = [dynamic_int8.quantize(layer.weight_rows(torch.arange(i, min(i + ROWS_AT_ONCE, n))))
             for i in range(0, n, ROWS_AT_ONCE)]
    return torch.cat([codes for codes, _ in parts]), torch.cat([scales for _, scales in parts])


class Int8Linear(nn.Module):
    """A linear layer's int8 copy: the packed weight (kernels.dynamic_int8.pack, bias included) and nothing else.
    `weight` is a meta tensor of the original's shape and dtype, as a lean layer's (its readers want the shape)."""

    def __init__(self, layer: Packable):
        super().__init__()
        self.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"), requires_grad=False)
        self.packed = dynamic_int8.pack(*quantized_rows(layer), getattr(layer, "bias", None))
        self.has_bias = layer.bias is not None

    def codes_and_scales(self) -> tuple[Tensor, Tensor]:
        return dynamic_int8.unpack(self.packed)

    def forward(self, x: Tensor) -> Tensor:
        return dynamic_int8.linear(x, self.packed)


class Int8Transformer(Transformer):
    """A Transformer sharing everything with the one it copies but its linear layers (Int8Linear)."""

    def pack_for_cpu(self, lean: bool = False) -> "Int8Transformer":
        return self  # already in its one CPU layout


def _mirror(module: nn.Module) -> nn.Module:
    """`module`'s tree with every linear layer replaced by its int8 copy; leaves without one are shared as they are."""
    if isinstance(module, Packable):
        return Int8Linear(module)
    if not module._modules:
        return module
    clone = copy.copy(module)  # a new module object over the same parameter and buffer dicts
    clone._modules = {name: None if child is None else _mirror(child) for name, child in module._modules.items()}
    return clone


def int8_copy(model: Transformer) -> Int8Transformer:
    """The int8 copy of `model` (CPU inference only: fbgemm's product runs on a CPU)."""
    if model.device.type != "cpu":
        raise ValueError(f"an int8 draft copy runs on a CPU; the model is on {model.device}")
    with torch.inference_mode(False), torch.no_grad():
        copied = _mirror(model)
    copied.__class__ = Int8Transformer
    return copied.eval().requires_grad_(False)
