"""Symmetric int8 / int4 quantisation along the last dim, torch reference + Triton kernel for each.

Used for the KV cache (a row is one (token, head) vector of head_dim values) and, by runtime/weight_quant.py,
for drafter weights (a row is one output channel).

Formats, for x [..., D]:
  int8          q [..., D] int8 in [-127, 127], scale [...] = absmax(row) / 127
  int4          packed [..., D/2] uint8, scale [..., D/G] = absmax(group) / 7, codes in [-7, 7]
  hierarchical  (QuantSpec) the int8 code q8 split into its two's-complement nibbles:
                  u = q8 >> 4  (= floor(q8 / 16), in [-8, 7])   -> `upper` plane, packed
                  l = q8 & 15  (= q8 - 16 u,      in [0, 15])   -> `lower` plane, packed
                so 16 u + l == q8 exactly for every int8 value and dequant_full == int8 dequant bit for bit.
                A drafter reads only `upper` (half the bytes): (16 u + 8) * scale, the midpoint of the 16
                int8 codes that nibble covers, so |error| <= 8.5 * scale instead of 16 * scale for 16 u alone.
Packing: element 2i in the low nibble of byte i, element 2i+1 in the high nibble.
Rounding is floor(y + 0.5) in both implementations so they agree bit for bit; an all-zero row or group gets
scale 0 and decodes to zeros.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

INT8_MAX = 127
INT4_MAX = 7


def _check_float(x: torch.Tensor, group_size: int | None = None) -> None:
    """x must be floating [..., D]; with a group size (anything packed two per byte), D splits into even groups."""
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"expected a floating tensor [..., D], got {x.dtype} {tuple(x.shape)}")
    if group_size is not None and (group_size < 2 or group_size % 2 or x.shape[-1] % group_size):
        raise ValueError(f"last dim {x.shape[-1]} must be a positive multiple of an even group size, "
                         f"got group size {group_size}")


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or packed.shape[:-1] != scale.shape[:-1] or scale.shape[-1] == 0 \
            or packed.shape[-1] % scale.shape[-1]:
        raise ValueError(f"expected packed uint8 [..., D/2] and scale [..., D/G] with matching leading dims, "
                         f"got {packed.dtype} {tuple(packed.shape)} and {tuple(scale.shape)}")


def _scale_and_codes(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] float -> (scale [...] fp32, integer-valued fp32 codes [..., n]) over the last dim."""
    x = x.float()
    scale = x.abs().amax(-1) * (1.0 / qmax)  # a product, not a quotient: torch on CUDA divides by a scalar this way
    safe = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    return scale, torch.floor(x / safe + 0.5).clamp(-qmax, qmax)  # round half up, exactly as the kernels do


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    nib = codes.to(torch.int16) & 15
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def _nibble_table(signed: bool) -> torch.Tensor:
    """[256, 2] fp32: the (low, high) nibble values of every byte, two's complement when signed."""
    byte = torch.arange(256)
    nib = torch.stack((byte & 15, byte >> 4), -1)
    return (torch.where(nib >= 8, nib - 16, nib) if signed else nib).float()


_NIBBLES = {signed: _nibble_table(signed) for signed in (False, True)}


def _unpack_nibbles(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """packed uint8 [..., n] -> integer-valued fp32 codes [..., 2n]. One table lookup per byte: on CPU about 3x
    faster than unpacking with bit operations, which was most of the cost of reading an int4 KV history."""
    return torch.nn.functional.embedding(packed.long(), _NIBBLES[signed].to(packed.device)).flatten(-2)


def split_int8(q8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes -> (upper in [-8, 7], lower in [0, 15]) with 16 * upper + lower == q8 exactly."""
    q = q8.to(torch.int16)
    return q >> 4, q & 15


# ---- torch references -------------------------------------------------------------------------------------

def quantize_int8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q int8 [..., D], scale fp32 [...])."""
    _check_float(x)
    scale, codes = _scale_and_codes(x, INT8_MAX)
    return codes.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., D] integer codes * scale [...]; a single elementwise multiply, so no Triton kernel of its own."""
    return q.float() * scale.unsqueeze(-1)


def quantize_int4_torch(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed uint8 [..., D/2], scale fp32 [..., D/group_size])."""
    _check_float(x, group_size)
    scale, codes = _scale_and_codes(x.unflatten(-1, (-1, group_size)), INT4_MAX)
    return _pack_nibbles(codes.flatten(-2)), scale


def dequantize_int4_torch(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_packed(packed, scale)
    codes = _unpack_nibbles(packed, signed=True).unflatten(-1, (scale.shape[-1], -1))
    return (codes * scale.unsqueeze(-1)).flatten(-2)


def quantize_hierarchical_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (upper uint8 [..., D/2], lower uint8 [..., D/2], scale fp32 [...]): int8 as two nibbles."""
    _check_float(x, group_size=2)  # two codes per byte: D must be even
    q8, scale = quantize_int8_torch(x)
    upper, lower = split_int8(q8)
    return _pack_nibbles(upper), _pack_nibbles(lower), scale


def dequant_upper_torch(upper: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a drafter reads: (16 u + 8) * scale, from the upper plane alone."""
    _check_packed(upper, scale.unsqueeze(-1))
    return (_unpack_nibbles(upper, signed=True) * 16 + 8) * scale.unsqueeze(-1)


def dequant_full_torch(upper: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(16 u + l) * scale == the int8 dequantisation exactly."""
    _check_packed(upper, scale.unsqueeze(-1))
    q8 = _unpack_nibbles(upper, signed=True) * 16 + _unpack_nibbles(lower, signed=False)
    return dequantize_int8(q8, scale)


# ---- Triton kernels: one program per quantisation group, even and odd lanes loaded separately -----------------
# A group holds 2 * HALF elements; lane i of a program handles elements 2i and 2i+1, which share one byte.

@triton.jit
def _group_codes(x_ptr, group, HALF: tl.constexpr, QMAX: tl.constexpr):
    offs = tl.arange(0, HALF)
    base = x_ptr + group.to(tl.int64) * (2 * HALF)
    even = tl.load(base + 2 * offs).to(tl.float32)
    odd = tl.load(base + 2 * offs + 1).to(tl.float32)
    # Bit-exact with the torch reference on any device: the scale is one fp32 product with 1/QMAX (as torch on
    # CUDA computes a division by a scalar), and codes use IEEE division (div_rn), since Triton's fp32 `/` is
    # approximate on GPUs and flipped quotients lying on a .5 boundary (measured on an H100:
    # docs/logs/gpu-2026-11.md, "Triton kernels vs torch references (on the GPU, do_bench median)")
    scale = tl.maximum(tl.max(tl.abs(even), 0), tl.max(tl.abs(odd), 0)) * (1.0 / QMAX)
    safe = tl.where(scale > 0, scale, 1.0)
    q_even = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(even, safe) + 0.5), -QMAX), QMAX).to(tl.int32)
    q_odd = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(odd, safe) + 0.5), -QMAX), QMAX).to(tl.int32)
    return q_even, q_odd, scale


@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, scale_ptr, HALF: tl.constexpr, QMAX: tl.constexpr):
    group = tl.program_id(0)
    q_even, q_odd, scale = _group_codes(x_ptr, group, HALF, QMAX)
    out = q_ptr + group.to(tl.int64) * (2 * HALF) + 2 * tl.arange(0, HALF)
    tl.store(out, q_even.to(tl.int8))
    tl.store(out + 1, q_odd.to(tl.int8))
    tl.store(scale_ptr + group, scale)


@triton.jit
def _quant_int4_kernel(x_ptr, packed_ptr, scale_ptr, HALF: tl.constexpr, QMAX: tl.constexpr):
    group = tl.program_id(0)
    q_even, q_odd, scale = _group_codes(x_ptr, group, HALF, QMAX)
    byte = (q_even & 15) | ((q_odd & 15) << 4)
    tl.store(packed_ptr + group.to(tl.int64) * HALF + tl.arange(0, HALF), byte.to(tl.uint8))
    tl.store(scale_ptr + group, scale)


@triton.jit
def _quant_hierarchical_kernel(x_ptr, upper_ptr, lower_ptr, scale_ptr, HALF: tl.constexpr, QMAX: tl.constexpr):
    group = tl.program_id(0)
    q_even, q_odd, scale = _group_codes(x_ptr, group, HALF, QMAX)
    offs = group.to(tl.int64) * HALF + tl.arange(0, HALF)
    tl.store(upper_ptr + offs, (((q_even >> 4) & 15) | (((q_odd >> 4) & 15) << 4)).to(tl.uint8))
    tl.store(lower_ptr + offs, ((q_even & 15) | ((q_odd & 15) << 4)).to(tl.uint8))
    tl.store(scale_ptr + group, scale)


@triton.jit
def _signed_nibbles(byte):
    lo = byte & 15
    hi = byte >> 4
    return tl.where(lo >= 8, lo - 16, lo), tl.where(hi >= 8, hi - 16, hi)


@triton.jit
def _dequant_nibbles_kernel(packed_ptr, lower_ptr, scale_ptr, out_ptr, HALF: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: int4 codes * scale; 1: hierarchical upper only, (16u + 8) * scale; 2: hierarchical full, (16u + l)
    group = tl.program_id(0)
    offs = group.to(tl.int64) * HALF + tl.arange(0, HALF)
    c_even, c_odd = _signed_nibbles(tl.load(packed_ptr + offs).to(tl.int32))
    if MODE == 1:
        c_even = c_even * 16 + 8
        c_odd = c_odd * 16 + 8
    if MODE == 2:
        low = tl.load(lower_ptr + offs).to(tl.int32)
        c_even = c_even * 16 + (low & 15)
        c_odd = c_odd * 16 + (low >> 4)
    scale = tl.load(scale_ptr + group)
    out = out_ptr + 2 * offs
    tl.store(out, c_even.to(tl.float32) * scale)
    tl.store(out + 1, c_odd.to(tl.float32) * scale)


def _check_triton_group(d: int, group_size: int) -> None:
    if group_size & (group_size - 1) or group_size < 2:
        raise ValueError(f"the Triton kernels need a power-of-two group/row size, got {group_size} (last dim {d})")


def quantize_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float(x)
    D = x.shape[-1]
    _check_triton_group(D, D)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _quant_int8_kernel[(x.numel() // D,)](x.contiguous(), q, scale, HALF=D // 2, QMAX=INT8_MAX)
    return q, scale


def quantize_int4_triton(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float(x, group_size)
    _check_triton_group(x.shape[-1], group_size)
    packed = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // group_size), dtype=torch.float32, device=x.device)
    _quant_int4_kernel[(scale.numel(),)](x.contiguous(), packed, scale, HALF=group_size // 2, QMAX=INT4_MAX)
    return packed, scale


def quantize_hierarchical_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_float(x)
    D = x.shape[-1]
    _check_triton_group(D, D)
    upper = torch.empty((*x.shape[:-1], D // 2), dtype=torch.uint8, device=x.device)
    lower = torch.empty_like(upper)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _quant_hierarchical_kernel[(scale.numel(),)](x.contiguous(), upper, lower, scale, HALF=D // 2, QMAX=INT8_MAX)
    return upper, lower, scale


def _dequant_nibbles(packed: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor, mode: int) -> torch.Tensor:
    """Launch `_dequant_nibbles_kernel`; `lower` is read only in mode 2 (pass `packed` otherwise)."""
    half = packed.shape[-1] // scale.shape[-1]
    _check_triton_group(2 * packed.shape[-1], 2 * half)
    out = torch.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.float32, device=packed.device)
    _dequant_nibbles_kernel[(scale.numel(),)](packed.contiguous(), lower.contiguous(), scale.contiguous(), out,
                                              HALF=half, MODE=mode)
    return out


def dequantize_int4_triton(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_packed(packed, scale)
    return _dequant_nibbles(packed, packed, scale, mode=0)


def dequant_upper_triton(upper: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_packed(upper, scale.unsqueeze(-1))
    return _dequant_nibbles(upper, upper, scale.unsqueeze(-1), mode=1)


def dequant_full_triton(upper: torch.Tensor, lower: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_packed(upper, scale.unsqueeze(-1))
    return _dequant_nibbles(upper, lower, scale.unsqueeze(-1), mode=2)


# ---- dispatch: Triton on CUDA, the torch reference elsewhere ------------------------------------------------

def _on_device(reference: Callable, kernel: Callable) -> Callable:
    @functools.wraps(reference)
    def run(x: torch.Tensor, *args, **kwargs):
        return (kernel if x.is_cuda else reference)(x, *args, **kwargs)
    return run


quantize_int8 = _on_device(quantize_int8_torch, quantize_int8_triton)
quantize_int4 = _on_device(quantize_int4_torch, quantize_int4_triton)
dequantize_int4 = _on_device(dequantize_int4_torch, dequantize_int4_triton)
quantize_hierarchical = _on_device(quantize_hierarchical_torch, quantize_hierarchical_triton)
dequant_upper = _on_device(dequant_upper_torch, dequant_upper_triton)
dequant_full = _on_device(dequant_full_torch, dequant_full_triton)
