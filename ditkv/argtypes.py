"""argparse types for numeric flags: a bad value is a one-line usage error naming the flag, never a
traceback from deep inside the command."""

from __future__ import annotations

import argparse
import math


def _number(kind, text: str):
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count, a size), so a bad value is a one-line usage error."""
    v = _number(int, text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def nonneg_int(text: str) -> int:
    v = _number(int, text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def positive_float(text: str) -> float:
    v = _number(float, text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def finite_float(text: str) -> float:
    return _number(float, text)


def positive_int_list(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers >= 1, at least one."""
    vals = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r} names no value; give e.g. 1,2,4")
    return vals
