"""One speculative step, draft -> verify -> commit: draft trees (`tree.py`, EAGLE-2's `dynamic_tree.py`), the draft
budget (`draft_budget.py`), the `Drafter` interface (`drafter.py`), verification and sampling (`verify.py`,
`sampling.py`), the engine (`engine.py`) with its config (`engine_config.py`) and counters (`decode_stats.py`),
CUDA graphs of its steps (`cuda_graphs.py`) and the tau probe distill and calibrate measure with (`tau_probe.py`)."""
