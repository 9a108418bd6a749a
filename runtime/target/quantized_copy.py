"""A copy of a Transformer whose linear layers run quantised, built from the model in memory: the draft of
self-speculation (runtime/drafters/quantspec.py). Embedding, norms and rope tables are the original's own tensors,
shared, not copied; only the matmul weights get a second copy, in one of SCHEMES:
- "int4-g<G>": 4-bit codes in groups of G along k with an fp16 scale and minimum each, through our kernel
  (kernels/int4_gemm.py), about an eighth of fp32's bytes;
- "int8": per output channel, through fbgemm's dynamic product (kernels/dynamic_int8.py), a quarter of them.

The weights are read from the plain weight, or from our fp32 kernel's panels where a lean model keeps only those,
a slice of one layer's rows at a time, so building it holds little fp32 beyond the model.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import dynamic_int8, int4_gemm
from runtime.target.cpu_packing import Packable
from runtime.target.model import Transformer
from runtime.weight_quant import INT4_GROUP_SIZES, ROW_BLOCK, QuantScheme

SCHEMES = (*(QuantScheme(4, g).name for g in INT4_GROUP_SIZES), "int8")


def default_scheme() -> str:
    """The scheme a new quantspec bundle names: int4 where our kernel runs, int8 (fbgemm) elsewhere.
    Groups of 32 match GGUF's Q4_K blocks, so a checkpoint converted from one is read back nearly exactly."""
    return "int4-g32" if int4_gemm.available() else "int8"


def weight_slices(layer: Packable):
    """The layer's weight [N, K] in slices of ROW_BLOCK rows, each read on its own (a layer packed for oneDNN
    alone is read back whole, once: its layout gives no rows apart)."""
    n = layer.weight.shape[0]
    whole = layer.weight_rows() if layer.onednn_only else None
    for i in range(0, n, ROW_BLOCK):
        yield layer.weight_rows(torch.arange(i, min(i + ROW_BLOCK, n))) if whole is None else \
            whole[i:i + ROW_BLOCK]


class QuantizedLinear(nn.Module):
    """A linear layer's quantised copy: its packed weight (bias included) and nothing else. `weight` is a meta
    tensor of the original's shape and dtype, as a lean layer's (its readers want the shape)."""

    def __init__(self, layer: Packable):
        super().__init__()
        self.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"), requires_grad=False)
        bias = getattr(layer, "bias", None)
        self.bias = None if bias is None else bias.detach().float()


class Int8Linear(QuantizedLinear):
    def __init__(self, layer: Packable):
        super().__init__(layer)
        parts = [dynamic_int8.quantize(rows) for rows in weight_slices(layer)]
        codes, scales = (torch.cat(t) for t in zip(*parts))
        self.packed = dynamic_int8.pack(codes, scales, self.bias)

    def quantized(self) -> tuple[Tensor, Tensor]:
        """(codes, scales), read back from the packed weight."""
        return dynamic_int8.unpack(self.packed)

    def forward(self, x: Tensor) -> Tensor:
        return dynamic_int8.linear(x, self.packed)


class Int4Linear(QuantizedLinear):
    def __init__(self, layer: Packable, group: int):
        super().__init__(layer)
        self.group = group
        self.pad = -layer.weight.shape[1] % group  # zero columns (and zero inputs) fill the last group
        # ROW_BLOCK is a multiple of the panel's 16 rows: the slices' panels concatenate
        self.panels = torch.cat([int4_gemm.pack(*int4_gemm.quantize(F.pad(rows, (0, self.pad)), group))
                                 for rows in weight_slices(layer)])

    def quantized(self) -> tuple[Tensor, Tensor, Tensor]:
        """(codes, scales, minimums) over the zero-padded columns, read back from the panels."""
        return int4_gemm.unpack(self.panels, self.weight.shape[0])

    def forward(self, x: Tensor) -> Tensor:
        x = F.pad(x, (0, self.pad)) if self.pad else x
        return int4_gemm.linear(x, self.panels, self.weight.shape[0], self.group, self.bias)


class QuantizedTransformer(Transformer):
    """A Transformer sharing everything with the one it copies but its linear layers (QuantizedLinear)."""

    def pack_for_cpu(self, lean: bool = False) -> "QuantizedTransformer":
        return self  # already in its one CPU layout


def quantized_layer(layer: Packable, scheme: str) -> QuantizedLinear:
    parsed = QuantScheme.parse(scheme)
    return Int8Linear(layer) if parsed.bits == 8 else Int4Linear(layer, parsed.group_size)


def _mirror(module: nn.Module, scheme: str) -> nn.Module:
    """`module`'s tree with every linear layer replaced by its quantised copy; leaves without one are shared."""
    if isinstance(module, Packable):
        return quantized_layer(module, scheme)
    if not module._modules:
        return module
    clone = copy.copy(module)  # a new module object over the same parameter and buffer dicts
    clone._modules = {name: None if child is None else _mirror(child, scheme)
                      for name, child in module._modules.items()}
    return clone


def quantized_copy(model: Transformer, scheme: str) -> QuantizedTransformer:
    """The copy of `model` in `scheme` (CPU inference only: both kernels run on a CPU)."""
    if scheme not in SCHEMES:
        raise ValueError(f"weight scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if model.device.type != "cpu":
        raise ValueError(f"a quantised draft copy runs on a CPU; the model is on {model.device}")
    with torch.inference_mode(False), torch.no_grad():
        copied = _mirror(model, scheme)
    copied.__class__ = QuantizedTransformer
    return copied.eval().requires_grad_(False)
