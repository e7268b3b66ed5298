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


def _at_least(kind: type, low: int, strict: bool, words: str):
    def parse(text: str):
        value = _number(text, kind)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    return parse


positive_float = _at_least(float, 0, True, "positive")
non_negative_float = _at_least(float, 0, False, "0 or more")
positive_int = _at_least(int, 1, False, "at least 1")
non_negative_int = _at_least(int, 0, False, "0 or more")


def port_number(text: str) -> int:
    """A TCP port: 1-65535 (a larger number wraps around in the socket call)."""
    value = _number(text, int)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1-65535)")
    return value
