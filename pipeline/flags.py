"""Command-line flags: a parser whose usage errors are one line, and numbers checked while they are parsed."""
from __future__ import annotations

import argparse
import math
from typing import Callable


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2) instead of the usage text and the error below it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def bounded(kind: type, low: float, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse `type`: `kind`(text), finite, >= low (> low with `above`) and <= high where one is given."""
    expected = f"{'an int' if kind is int else 'a number'} {'>' if above else '>='} {low:g}" + \
        ("" if high is None else f" and <= {high:g}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (above and value == low) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return value

    return parse
