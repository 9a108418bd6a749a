"""Code several drafter kinds share: the draft head over a reduced vocabulary (`draft_head.py`), EAGLE's drafting
steps (`eagle_drafting.py`, batched in `eagle_batch.py`, static shapes in `eagle_static.py`) and batched drafting
for every kind (`batch_drafter.py`)."""
