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

from dataclasses import dataclass

import torch

from kernels.kv_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

QWEIGHT, SCALES = ".qweight", ".scales"
INT4_GROUP_SIZES = (32, 64, 128)


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
    if scheme.bits == 8:
        return quantize_int8(w)
    if w.shape[1] % scheme.group_size:
        raise ValueError(f"input dim {w.shape[1]} is not a multiple of the {scheme.name} group size")
    return quantize_int4(w, scheme.group_size)


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, scheme: QuantScheme | str,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    scheme = _as_scheme(scheme)
    w = dequantize_int8(codes, scales) if scheme.bits == 8 else dequantize_int4(codes, scales)
    return w.to(dtype)


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
    `quantized` in turn: no whole restored copy beside the original."""
    def error(name: str, w: torch.Tensor) -> float:
        restored = dequantize_weight(quantized[name + QWEIGHT], quantized[name + SCALES], scheme)
        return ((restored - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item()

    return {name: error(name, w) for name, w in sd.items() if is_quantizable(w)}
