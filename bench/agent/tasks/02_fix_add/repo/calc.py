"""Tiny calculator used by the billing service."""


def add(a: float, b: float) -> float:
    """Return the sum of a and b."""
    return a - b


def mul(a: float, b: float) -> float:
    """Return the product of a and b."""
    return a * b
