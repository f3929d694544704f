"""Readers of settings given as text (command-line flags): each turns the text into a value or
raises argparse.ArgumentTypeError with what is wrong, which argparse prints after the flag's
name. Plain Python, no torch: `kvbatch status` builds the engine's flags too."""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'4GiB', '4G', '512M', '1.5g' or plain bytes -> bytes (binary units, as torch reports
    memory)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give e.g. 4GiB, 512M or bytes")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be above 0 bytes, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A share of memory in (0, 1]."""
    value = _number(text, float)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (e.g. 0.9), got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two (e.g. 16), got {text}")
    return value


def step_ratio(text: str) -> float:
    """Plain decode steps' time a step with a long prompt's chunk may take: > 1, or 0 (off)."""
    value = _number(text, float)
    if value != 0 and not value > 1:
        raise argparse.ArgumentTypeError(f"must be above 1, or 0 to turn it off, got {text}")
    return value


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
