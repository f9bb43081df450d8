"""HTTP client for `POST /v1/tab`, `/v1/tab/feedback` and `/v1/tab/prefill`, shared by `codeplane complete`,
`codeplane tab-feedback` and `codeplane lsp`.

Source code leaves the machine only over TLS: plain http is accepted for loopback servers
and refused for anything else.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from codeplane.core.http import api_headers
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


def complete(server: str, body: dict, api_key: str | None = None, timeout: float = 60.0
             ) -> dict:
    return _post(server, "/v1/tab", body, api_key, timeout)


def feedback(server: str, suggestion_id: str, outcome: str, shown_ms: float,
             api_key: str | None = None, timeout: float = 10.0) -> dict:
    """Report that a shown suggestion was accepted or rejected (`POST /v1/tab/feedback`)."""
    return _post(server, "/v1/tab/feedback", _verdict(suggestion_id, outcome, shown_ms),
                 api_key, timeout)


def _verdict(suggestion_id: str, outcome: str, shown_ms: float) -> dict:
    return {"id": suggestion_id, "outcome": outcome, "shown_ms": round(shown_ms, 1)}


def _post(server: str, route: str, body: dict, api_key: str | None, timeout: float) -> dict:
    url = check_transport(server)
    try:
        response = httpx.post(f"{url}{route}", json=body, headers=api_headers(api_key),
                              timeout=timeout)
    except httpx.HTTPError as exc:
        raise TabClientError(f"cannot reach {url}: {exc!r}") from None
    if response.status_code != 200:
        raise _error(response)
    return response.json()


class AsyncTabClient:
    """One connection pool for an editor session (the LSP server)."""

    def __init__(self, server: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.url = check_transport(server)
        self._http = httpx.AsyncClient(timeout=timeout, headers=api_headers(api_key))

    async def complete(self, body: dict) -> dict:
        return await self._post("/v1/tab", body)

    async def next_edit(self, body: dict, timeout: float = 120.0) -> dict:
        return await self._post("/v1/tab/next", body, timeout)

    async def feedback(self, suggestion_id: str, outcome: str, shown_ms: float) -> dict:
        return await self._post("/v1/tab/feedback", _verdict(suggestion_id, outcome, shown_ms))

    async def prefill(self, body: dict) -> dict:
        return await self._post("/v1/tab/prefill", body)

    async def next_prefill(self, body: dict) -> dict:
        return await self._post("/v1/tab/next/prefill", body)

    async def _post(self, route: str, body: dict, timeout: float | None = None) -> dict:
        try:
            response = await self._http.post(f"{self.url}{route}", json=body,
                                              timeout=timeout or self._http.timeout)
        except httpx.HTTPError as exc:
            raise TabClientError(f"cannot reach {self.url}: {exc!r}") from None
        if response.status_code != 200:
            raise _error(response)
        return response.json()

    async def close(self) -> None:
        await self._http.aclose()
