"""Speculation."""
