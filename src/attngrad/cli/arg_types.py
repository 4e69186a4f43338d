"""argparse types that refuse out-of-range numbers at parse time, so the error names the
flag (argparse prints "argument --steps: ...") before any work or progress bar starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _bounded(kind: type, test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}; got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {what}; got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _bounded(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _bounded(int, lambda v: v >= 0, "an integer >= 0")
nonnegative_float = _bounded(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
probability = _bounded(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
fraction = _bounded(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
