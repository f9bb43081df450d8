def safe_max(values: list[float]) -> float | None:
    """Largest value, or None when there are no values."""
    return max(values)
