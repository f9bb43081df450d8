"""HTTP client for `POST /v1/tab`, shared by `codeplane complete` and `codeplane lsp`.

Source code leaves the machine only over TLS: plain http is accepted for loopback servers
and refused for anything else.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from codeplane.net import is_loopback


class TabClientError(Exception):
    """The server could not be reached or answered with an error; the message says which."""


def check_transport(url: str) -> str:
    """Return `url` without a trailing slash, or raise when it would send code in clear."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TabClientError(f"server URL must be http(s)://host[:port], got {url!r}")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise TabClientError(f"refusing to send source code to {parts.hostname} without TLS; "
                             "use https:// for servers that are not on this machine")
    return url.rstrip("/")


def _error(response: httpx.Response) -> TabClientError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return TabClientError(f"server answered {response.status_code}: {message}")


def complete(server: str, body: dict, timeout: float = 60.0) -> dict:
    url = check_transport(server)
    try:
        response = httpx.post(f"{url}/v1/tab", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise TabClientError(f"cannot reach {url}: {exc}") from None
    if response.status_code != 200:
        raise _error(response)
    return response.json()


class AsyncTabClient:
    """One connection pool for an editor session (the LSP server)."""

    def __init__(self, server: str, timeout: float = 30.0) -> None:
        self.url = check_transport(server)
        self._http = httpx.AsyncClient(timeout=timeout)

    async def complete(self, body: dict) -> dict:
        try:
            response = await self._http.post(f"{self.url}/v1/tab", json=body)
        except httpx.HTTPError as exc:
            raise TabClientError(f"cannot reach {self.url}: {exc}") from None
        if response.status_code != 200:
            raise _error(response)
        return response.json()

    async def close(self) -> None:
        await self._http.aclose()
