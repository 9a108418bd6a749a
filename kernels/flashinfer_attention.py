"""flashinfer attention backend (issue #8, GPU only): decode through `single_decode_with_kv_cache`, prefill and tree
verification through `single_prefill_with_kv_cache` with a custom mask. Registered by runtime/attention.py only when
the `flashinfer` package is installed (the optional extra `gpu`); flashinfer itself is imported on first use.

Falls back to torch SDPA (the reference) where flashinfer has no kernel for the call: fp32 tensors, batch > 1,
and SpecAttn per-kv-head keep masks (a flashinfer custom mask is shared by all heads).

`python -m kernels.flashinfer_attention` compares it with the sdpa backend on random inputs and times both.
"""
from __future__ import annotations

import torch
from torch import Tensor


class FlashInferBackend:
    """An runtime.attention.AttentionBackend (duck-typed here so kernels/ does not import runtime/)."""

    name = "flashinfer"

    def __init__(self):
        self._fi = None

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return device.type == "cuda"

    def _flashinfer(self):
        if self._fi is None:
            import flashinfer

            self._fi = flashinfer
        return self._fi

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, keep: Tensor | None) -> Tensor:
        B, H, T, D = q.shape
        if B != 1 or keep is not None or q.dtype not in (torch.float16, torch.bfloat16):
            from runtime.attention import BACKENDS

            return BACKENDS["sdpa"](q, keys, values, mask, keep)
        fi = self._flashinfer()
        k, v = keys[0], values[0]  # [Hkv, S, D]: flashinfer's HND layout
        if not (k.is_contiguous() and v.is_contiguous()):
            k, v = k.contiguous(), v.contiguous()
        if T == 1 and mask is None:
            out = fi.single_decode_with_kv_cache(q[0, :, 0], k, v, kv_layout="HND")  # [H, D]
            return out.view(1, H, 1, D)
        qt = q[0].transpose(0, 1).contiguous()  # [T, H, D]
        if mask is None:
            out = fi.single_prefill_with_kv_cache(qt, k, v, causal=True, kv_layout="HND")
        else:
            out = fi.single_prefill_with_kv_cache(qt, k, v, custom_mask=mask[0, 0].contiguous(), kv_layout="HND")
        return out.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]


def _check() -> int:
    import triton.testing

    from runtime.attention import BACKENDS
    from runtime.model import attention_mask

    sdpa, fi = BACKENDS["sdpa"], FlashInferBackend()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'case':<34}{'rel err':>10}{'sdpa ms':>10}{'flashinfer ms':>15}")
    for H, Hkv, D in ((9, 3, 64), (32, 8, 128)):
        for S, T in ((256, 1), (2048, 1), (256, 6), (2048, 6), (256, 64)):
            dt = torch.bfloat16
            q = torch.randn(1, H, T, D, generator=g, device="cuda").to(dt)
            k = torch.randn(1, Hkv, S + 64, D, generator=g, device="cuda").to(dt)[:, :, :S]  # a cache slice
            v = torch.randn(1, Hkv, S + 64, D, generator=g, device="cuda").to(dt)[:, :, :S]
            mask = None
            if T > 1:  # a random tree (each node's parent an earlier node or the root) over a committed prefix
                par = torch.tensor([-1] + [int(torch.randint(-1, i, (1,))) for i in range(T - 2)])
                tm = torch.zeros(T, T, dtype=torch.bool)
                tm[:, 0] = True
                for i, p in enumerate(par.tolist()):
                    tm[i + 1] = tm[p + 1]
                    tm[i + 1, i + 1] = True
                lengths = torch.tensor([S - T], device="cuda")
                pos = (lengths + torch.arange(T, device="cuda"))[None]
                mask = attention_mask(lengths, pos, S, tm.cuda())
            ref = sdpa(q.double().float(), k.float(), v.float(), mask, None)
            got = fi(q, k, v, mask, None).float()
            err = float((got - ref).norm() / ref.norm())
            t_s = triton.testing.do_bench(lambda: sdpa(q, k, v, mask, None), return_mode="median")
            t_f = triton.testing.do_bench(lambda: fi(q, k, v, mask, None), return_mode="median")
            print(f"{f'H{H}/{Hkv} D{D} S{S} T{T}':<34}{err:>10.2e}{t_s:>10.4f}{t_f:>15.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_check())
