"""The runtime: the one definition of every model, used to train, to calibrate, to validate and to serve.

- `target/`: the target model (`model.py`, one cached and one uncached forward), loading HF and GGUF weights
  (`loading.py`), KV caches (plain and quantised), CPU weight packing, the attention backends (`attention/`).
- `speculation/`: one speculative step and what it is made of: draft trees (static and dynamic), verification,
  sampling, the draft budget, the `Drafter` interface, the engine, its config and counters, CUDA graphs.
- `serving/`: many requests at once: the batched engine, the scheduler, the served-engine builder and the draft
  budget autotuners.
- `drafters/`: the drafter kinds, one module each (a registry), with the code several kinds share in `shared/`.
- `bundle_reader.py`: the exported bundle, every hash checked; `weight_quant.py`: a drafter's packed weights;
  `files.py` and `device.py`: hashing and device synchronisation shared by the layers above.
"""
