"""The calibrate stage. Its code lives a layer below, in export.calibrate (weight and KV quantisation, the draft
budget, the SpecAttn layer map), and reads a StageContext through the CalibrateContext protocol there."""
from export.calibrate.stage import run_calibrate

__all__ = ["run_calibrate"]
