"""Network helpers shared by client and server code."""

from __future__ import annotations

import ipaddress
from typing import Any

import httpx


def is_loopback(host: str | None) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1: traffic that never leaves this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def api_headers(api_key: str | None) -> dict[str, str]:
    """How every client presents its key to a codeplane server (`Authorization: Bearer`,
    what the auth gate reads); no header without a key, for a keyless loopback server."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def api_client(api_key: str | None, timeout: float | None = 60.0,
               **options: Any) -> httpx.Client:
    """An HTTP client to a codeplane server that sends `api_key` with every request."""
    return httpx.Client(timeout=timeout, headers=api_headers(api_key), **options)
