"""Serving many requests: the batched engine (`batch_engine.py`: every row drafts its own tree, one target forward
verifies them all), the scheduler that owns it (`scheduler.py`), the one function that builds a served engine from a
bundle (`served_engine.py`, which validate measures too) and the autotuners of the draft budget on the serving
device."""
