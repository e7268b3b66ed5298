"""argparse types for numbers, so that a bad value is one usage line naming the flag rather than a
traceback (or a silent surprise: inf, NaN, a port that wraps around) deep inside a service."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a{'n integer' if kind is int else ' number'}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def port_number(text: str) -> int:
    """A TCP port: 1-65535 (a larger number wraps around in the socket call)."""
    value = _number(text, int)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1-65535)")
    return value
