"""Attention backends (a registry: base.py), the masks they take (masks.py) and SpecAttn's key selection
(specattn.py).

"sdpa" (torch SDPA) runs everywhere and is the reference; "triton_sparse" (CUDA, or Triton's CPU interpreter) reads
only SpecAttn's kept keys; "flashinfer" (CUDA) registers where the package is installed.
"""
import importlib.util

from runtime.target.attention.base import (AUTO_ORDER, BACKEND_ENV, BACKENDS, AttentionBackend, attention_weights,
                                    draft_attention_dtype, exact_dtype, last_query_row, pick_backend,
                                    register_backend)
from runtime.target.attention.masks import Causal, Mask, attention_mask, causal_mask, dense_mask
from runtime.target.attention.sdpa import SdpaBackend
from runtime.target.attention.specattn import SpecAttnConfig, head_groups, kept_keys, kv_reads, query_slices
from runtime.target.attention.triton_sparse import TritonSparseBackend

register_backend(SdpaBackend())
register_backend(TritonSparseBackend())
if importlib.util.find_spec("flashinfer") is not None:  # found without importing it: that happens on first use
    from runtime.target.attention.flashinfer import FlashInferBackend

    register_backend(FlashInferBackend())

__all__ = ["AUTO_ORDER", "BACKEND_ENV", "BACKENDS", "AttentionBackend", "Causal", "Mask", "SpecAttnConfig",
           "attention_mask", "attention_weights", "causal_mask", "dense_mask", "draft_attention_dtype", "exact_dtype",
           "head_groups", "kept_keys", "kv_reads", "last_query_row", "pick_backend", "query_slices",
           "register_backend"]
