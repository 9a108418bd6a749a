"""Shared drafter code."""
