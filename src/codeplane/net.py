"""Network helpers shared by client and server code (API keys on requests: `core/http.py`)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1: traffic that never leaves this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False
