def last_n(items: list, n: int) -> list:
    """Return the last n items (all of them if there are fewer than n)."""
    if n <= 0:
        return []
    return items[-n - 1:]
