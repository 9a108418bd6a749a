"""Calibration: the measurements that turn a trained drafter into the settings a bundle serves with."""
