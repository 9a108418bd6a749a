"""How a linear layer's weight runs on the CPU: prepacked for oneDNN, through our own fp32 kernel, or plain.

MKL re-packs a weight on every call, so a few-row product (a tree verify) costs well over a one-row one (a decode).
Prepacked once, oneDNN runs both at about the cost of streaming the weight. The choice per CPU kind, and why, is
measured in docs/logs/cpu-2026-11.md, "`pipeline bench` on CPU".
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import cpu_gemm
from runtime.target.thread_flag import ThreadFlag


def packed_min_fp32_rows(cpu_vendor: str) -> int:
    """From how many rows an fp32 product runs prepacked: MKL's own kernel wins for fewer rows on Intel CPUs, and
    takes a generic path elsewhere."""
    return 4 if cpu_vendor == "GenuineIntel" else 1


def own_fp32_kernel(cpu_vendor: str) -> bool:
    """Whether fp32 inference products run through kernels/cpu_gemm.py instead of oneDNN: on AMD CPUs, where it was
    measured faster; Intel CPUs keep MKL and oneDNN, which were tuned there."""
    return cpu_vendor == "AuthenticAMD"


PACKED_MIN_FP32_ROWS = packed_min_fp32_rows(cpu_gemm.cpu_info("vendor_id"))
OWN_FP32_KERNEL = own_fp32_kernel(cpu_gemm.cpu_info("vendor_id"))
# Our kernel serves products of up to this many rows (every decode, verify and short prefill), so a verify of up to
# 255 draft nodes equals decoding bit for bit; oneDNN is faster on longer prefills.
OWN_MAX_ROWS = 256
# oneDNN's prepacked bf16 product sums a row in one order from 5 to 32 rows and in others below and above (on an AMX
# host, K=8960): a decode's and a verify's rows agree bit for bit only if every product outside a prefill has
# PACKED_MIN_ROWS to PACKED_EXACT_ROWS rows: fewer are padded with zero rows, more go in slices, or greedy speculation
# drifts from plain decoding. 8 padded rows cost no more than one
# (docs/qwen.md, "QuantSpec over the target's KV cache, and lossless bf16 (Intel host, 2026-12-06, night)")
PACKED_EXACT_ROWS = 32
PACKED_MIN_ROWS = 8
# inside prefill_products: our kernel's fp32 products up to this many rows, oneDNN's from there, which wins on a
# prefill's hundreds of rows (docs/logs/cpu-2026-11.md,
# "Long prompts: maskless causal prefill in chunks (2026-11-28)")
PREFILL_OWN_MAX_ROWS = 64
_prefill = ThreadFlag()  # per thread: an engine prefilling in one thread leaves another's verify exact


def prefill_products():
    """Products inside take the fastest kernel for their row count, whether or not a row then equals its one-row
    product: a prefill's rows are never compared with a decode's, only a verify's are."""
    return _prefill.raised()


class Packable:
    """A module whose matmul weight can carry a prepacked copy for CPU inference (`pack`). The plain weight stays:
    training, export and embedding lookups read it, and non-CPU inputs fall back to it. `pack(lean=True)` keeps one
    copy instead, the packed one that serves every product (inference only: the plain weight becomes a meta tensor,
    its shape and dtype kept)."""

    weight: Tensor
    packed: Tensor | None = None
    panels: Tensor | None = None  # the weight packed for kernels/cpu_gemm.py, where its fp32 products of few rows run

    def pack(self, lean: bool = False, keep_plain: bool = False) -> None:
        own = OWN_FP32_KERNEL and self.weight.dtype == torch.float32 and cpu_gemm.serves(self.weight)
        self.panels = cpu_gemm.pack(self.weight) if own else None
        # the blocked layout oneDNN picks for a 16-row batch serves 1..16 rows about equally well; lean, our kernel
        # alone serves every product where it runs (beside a kept plain weight, the rows past its limit)
        self.packed = None if lean and own else torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
        if lean and not keep_plain:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    @property
    def lean(self) -> bool:
        return self.weight.is_meta and (self.panels is not None or self.packed is not None)

    def unpack(self) -> None:
        if self.lean:
            raise RuntimeError("a lean Linear has no plain weight to unpack to (load it without lean)")
        self.packed = self.panels = None

    def weight_rows(self, ids: Tensor | None = None) -> Tensor:
        """The plain weight [N, K], or its rows `ids`: read from our kernel's panels where a lean layer keeps only
        those (an exact copy)."""
        if not self.weight.is_meta:
            return self.weight.detach() if ids is None else self.weight.detach()[ids]
        if self.onednn_only:  # oneDNN's blocked layout is opaque: read it back through products
            weight = self.onednn_weight()
            return weight if ids is None else weight[ids]
        return cpu_gemm.unpack(self.panels, self.weight.shape[0], ids)

    @property
    def onednn_only(self) -> bool:
        """Whether the one copy kept is oneDNN's packed weight, which gives no rows apart."""
        return self.weight.is_meta and self.panels is None

    def onednn_weight(self, cols: int = 512) -> Tensor:
        """The whole weight [N, K] of a layer packed for oneDNN alone: the identity's rows times it are the
        weight's columns, exactly (each output is one weight times 1, plus zeros)."""
        k = self.weight.shape[1]
        eye = torch.eye(k, dtype=self.packed.dtype)
        return torch.cat([self._packed(eye[i:i + cols], None) for i in range(0, k, cols)]).t().contiguous()

    @property
    def own_fp32(self) -> bool:
        return self.panels is not None

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        # neither fast path has a backward: they serve only forwards no gradient flows through
        inference = x.device.type == "cpu" and not (torch.is_grad_enabled()
                                                    and (x.requires_grad or self.weight.requires_grad))
        prefill = _prefill.on
        own_rows = PREFILL_OWN_MAX_ROWS if prefill else OWN_MAX_ROWS
        lean = self.weight.is_meta  # no plain weight: the one packed copy takes every product
        if self.own_fp32 and inference and x.dtype == torch.float32 and (lean or x.numel() <= own_rows * x.shape[-1]):
            return cpu_gemm.small_linear(x, self.panels, self.weight.shape[0], bias)
        # inductor lowers a prepacked product only for a weight it froze and packed itself: traced by torch.compile,
        # the plain product lets it choose
        prepacked = self.packed is not None and inference and (lean or not torch.compiler.is_compiling())
        if prepacked and x.dtype == self.packed.dtype \
                and (x.dtype != torch.float32 or lean or x.numel() >= PACKED_MIN_FP32_ROWS * x.shape[-1]):
            if x.dtype == torch.bfloat16 and not prefill:
                parts = [self._packed_padded(r, bias) for r in x.reshape(-1, x.shape[-1]).split(PACKED_EXACT_ROWS)]
                return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(*x.shape[:-1], -1)
            return self._packed(x, bias)
        if lean:
            raise RuntimeError(f"a lean Linear (packed weights only) cannot take a {x.dtype} input on {x.device} with "
                               f"gradients {'on' if torch.is_grad_enabled() else 'off'}: load it without lean")
        return F.linear(x, self.weight, bias)

    def _packed(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def _packed_padded(self, rows: Tensor, bias: Tensor | None) -> Tensor:
        """rows [M, K] of at most PACKED_EXACT_ROWS, each summed as in a product of PACKED_MIN_ROWS or more."""
        m = rows.shape[0]
        if m >= PACKED_MIN_ROWS:
            return self._packed(rows, bias)
        return self._packed(F.pad(rows, (0, 0, 0, PACKED_MIN_ROWS - m)), bias)[:m]


class Linear(nn.Linear, Packable):
    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x, self.bias)


@lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack `dtype` weights on this CPU: its bf16 path needs AVX-512 (bw, vl, dq) or
    AVX-NE-CONVERT (probed once, as torch decides it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 16)
    except RuntimeError:
        return False
    return True


def pack_for_cpu(model: nn.Module, lean: bool = False, keep_plain: tuple[nn.Module, ...] = ()) -> nn.Module:
    """Prepack every Packable's weight; a no-op off CPU or where oneDNN cannot pack its dtype. Call it after the
    last .to() and the last weight update: packed copies neither move nor follow the weights. `lean`: one copy of
    each weight, the packed one (Packable.pack), except in `keep_plain` and where the weight is shared (a tied
    head: its embedding lookups read it)."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    shared = {i for i, n in counts.items() if n > 1}
    for module in model.modules():
        if isinstance(module, Packable) and module.weight.device.type == "cpu" and onednn_packs(module.weight.dtype):
            module.pack(lean, keep_plain=module in keep_plain or id(module.weight) in shared)
    return model
