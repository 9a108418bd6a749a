"""The target model: the transformer and its forwards (`model.py`), HF/GGUF weight loading (`loading.py`), KV caches
(`kv_cache.py`, quantised in `quant_kv_cache.py`), CPU weight packing (`cpu_packing.py`), the float precision the
host runs fastest (`precision.py`) and the attention backends (`attention/`)."""
