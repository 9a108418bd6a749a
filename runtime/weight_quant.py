"""Drafter weight quantisation: a state dict <-> packed codes + scales; calibrate picks a scheme, export ships the
packed weights in the bundle, and the bundle reader restores them (runtime.drafters.bundle_weights).

Schemes: "int8" (per output channel) and "int4-g32" / "int4-g64" / "int4-g128" (group-wise along the input
dim, two codes per byte). Only 2-D floating matrices (linear and embedding weights) are quantised; norms,
biases and everything else pass through unchanged. The arithmetic is kernels/kv_quant.py's, with a row being
one output channel, so every element's error is at most half its scale:
    |W - dequant(W)| <= scale / 2   (scale = absmax(row) / 127, or absmax(group) / 7)
Stored names: `<name>.qweight` (int8 [out, in] or uint8 [out, in/2]) and `<name>.scales` (fp32 [out] or
[out, in/G]); the scheme's name goes in the bundle's metadata so the reader knows how to decode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.kv_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

QWEIGHT, SCALES = ".qweight", ".scales"
INT4_GROUP_SIZES = (32, 64, 128)
# rows (output channels) quantised, restored or compared at a time, here and in quantspec's copy: a 151,936-row
# embedding's float temporaries are then a block's few MB, not several copies of the whole matrix beside the model.
# A multiple of the int4 kernel's 16-row panels, so a copy's slices concatenate (runtime/target/quantized_copy.py)
ROW_BLOCK = 4096


@dataclass(frozen=True)
class QuantScheme:
    bits: int  # 8 or 4
    group_size: int = 0  # int4 only; int8 scales per output channel

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"quantisation bits must be 8 or 4, got {self.bits}")
        if self.bits == 8 and self.group_size != 0:
            raise ValueError(f"int8 is per output channel, got group size {self.group_size} (expected 0)")
        if self.bits == 4 and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")

    @property
    def name(self) -> str:
        return "int8" if self.bits == 8 else f"int4-g{self.group_size}"

    @classmethod
    def parse(cls, name: str) -> QuantScheme:
        """'int8' | 'int4-g32' | 'int4-g64' | 'int4-g128'."""
        if name == "int8":
            return cls(8)
        if name.startswith("int4-g") and name[len("int4-g"):].isdigit():
            return cls(4, int(name[len("int4-g"):]))
        raise ValueError(f"unknown quantisation scheme {name!r}: expected 'int8' or 'int4-g<32|64|128>'")


def _as_scheme(scheme: QuantScheme | str) -> QuantScheme:
    return scheme if isinstance(scheme, QuantScheme) else QuantScheme.parse(scheme)


def is_quantizable(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.is_floating_point()


def quantize_weight(w: torch.Tensor, scheme: QuantScheme | str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes, scales); see the module docstring for the layouts."""
    scheme = _as_scheme(scheme)
    if not is_quantizable(w):
        raise ValueError(f"expected a 2-D floating weight matrix, got {w.dtype} {tuple(w.shape)}")
    if scheme.bits == 4 and w.shape[1] % scheme.group_size:
        raise ValueError(f"input dim {w.shape[1]} is not a multiple of the {scheme.name} group size")
    blocks = [quantize_int8(b) if scheme.bits == 8 else quantize_int4(b, scheme.group_size)
              for b in w.split(ROW_BLOCK)]
    if len(blocks) == 1:
        return blocks[0]
    return torch.cat([codes for codes, _ in blocks]), torch.cat([scales for _, scales in blocks])


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, scheme: QuantScheme | str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    scheme = _as_scheme(scheme)
    columns = codes.shape[1] * (1 if scheme.bits == 8 else 2)
    w = torch.empty(codes.shape[0], columns, dtype=dtype, device=codes.device)
    for rows, c, s in zip(w.split(ROW_BLOCK), codes.split(ROW_BLOCK), scales.split(ROW_BLOCK)):
        rows.copy_(dequantize_int8(c, s) if scheme.bits == 8 else dequantize_int4(c, s))
    return w


def error_bound(scales: torch.Tensor, scheme: QuantScheme | str) -> torch.Tensor:
    """Per-element bound scale / 2 broadcast to the weight's shape [out, in]."""
    scheme = _as_scheme(scheme)
    if scheme.bits == 8:
        return (scales / 2).unsqueeze(-1)
    return (scales / 2).repeat_interleave(scheme.group_size, dim=-1)


def quantize_state_dict(sd: dict[str, torch.Tensor], scheme: QuantScheme | str) -> dict[str, torch.Tensor]:
    """Every 2-D floating tensor becomes `<name>.qweight` + `<name>.scales`; the rest is kept as is."""
    scheme = _as_scheme(scheme)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith((QWEIGHT, SCALES)):
            raise ValueError(f"state dict key {name!r} already looks quantised (ends with {QWEIGHT} or {SCALES})")
        if not is_quantizable(t):
            out[name] = t
            continue
        try:
            codes, scales = quantize_weight(t, scheme)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        out[name + QWEIGHT], out[name + SCALES] = codes, scales
    return out


def dequantize_state_dict(tensors: dict[str, torch.Tensor], scheme: QuantScheme | str,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_state_dict` (up to the error bound); pass-through tensors are returned unchanged."""
    scheme = _as_scheme(scheme)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(SCALES):
            continue
        if not name.endswith(QWEIGHT):
            out[name] = t
            continue
        base = name[: -len(QWEIGHT)]
        if base + SCALES not in tensors:
            raise ValueError(f"{name} has no matching {base + SCALES}")
        out[base] = dequantize_weight(t, tensors[base + SCALES], scheme, dtype)
    return out


def relative_errors(sd: dict[str, torch.Tensor], quantized: dict[str, torch.Tensor],
                    scheme: QuantScheme | str) -> dict[str, float]:
    """||W - W'||_F / ||W||_F per quantised matrix (the number the calibration report shows), each restored from
    `quantized` a block of rows at a time: no whole restored copy beside the original."""
    def error(name: str, w: torch.Tensor) -> float:
        error_sq = norm_sq = 0.0
        for rows, c, s in zip(w.split(ROW_BLOCK), quantized[name + QWEIGHT].split(ROW_BLOCK),
                              quantized[name + SCALES].split(ROW_BLOCK)):
            rows = rows.float()
            error_sq += (dequantize_weight(c, s, scheme) - rows).square().sum().item()
            norm_sq += rows.square().sum().item()
        return math.sqrt(error_sq) / max(math.sqrt(norm_sq), 1e-12)

    return {name: error(name, w) for name, w in sd.items() if is_quantizable(w)}
