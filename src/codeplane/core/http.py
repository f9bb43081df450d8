"""HTTP clients that present an API key: the one way every client of a codeplane server or
of an OpenAI-compatible upstream sends it."""

from __future__ import annotations

from typing import Any

import httpx


def api_headers(api_key: str | None) -> dict[str, str]:
    """How every client presents an API key (`Authorization: Bearer`): what codeplane's
    auth gate reads, and every OpenAI-compatible server. No header without a key (a keyless
    loopback server, an upstream that needs none)."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def api_client(api_key: str | None, timeout: float | None = 60.0,
               **options: Any) -> httpx.Client:
    """An HTTP client to a codeplane server that sends `api_key` with every request."""
    return httpx.Client(timeout=timeout, headers=api_headers(api_key), **options)
