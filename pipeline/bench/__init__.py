"""Benchmarks, profiles and device checks: above the runtime they measure, never imported by it."""
