"""The one HTTP client every remote provider (OpenAI-compatible, Anthropic) sends through.

aiohttp rather than httpx: httpx's pure-Python connection pool cost many times the CPU per
upstream call of aiohttp's (C HTTP parser, simple pool), and the upstream call was the largest
share of the gateway's per-request CPU (`bench/gateway.py`; docs/gateway.md, "Workers and the
hot path").

Transport failures and error statuses become `UpstreamError` here, before the first token,
so the router may retry elsewhere. Redirects are never followed: an upstream (or whoever
answers in its place) must not be able to send a client's request, or our API key, to
another address.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from codeplane.config.gateway import BaseUrl, DeploymentConfig
from codeplane.gateway.providers.base import UpstreamError, json_bytes, status_error

TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, ValueError)  # ValueError: an SSE line
# longer than aiohttp's read buffer ("Chunk too big")


class RemoteDeployment(DeploymentConfig):
    """A deployment on another machine: its address, and the environment variable that holds
    its API key (never the key: the file may be read by more people than the key)."""

    base_url: BaseUrl
    api_key_env: str | None = None

    @property
    def address(self) -> str:
        return self.base_url

    def api_key(self) -> str:
        return os.environ.get(self.api_key_env, "") if self.api_key_env else ""

    def share(self, workers: int) -> RemoteDeployment:
        """The upstream sees every server process at once, so its max_parallel, rpm and tpm
        are split between them (rounded up: a limit never drops to zero)."""
        if workers == 1:
            return self
        split = {f: -(-value // workers) for f in ("max_parallel", "rpm", "tpm")
                 if (value := getattr(self, f))}
        return self.model_copy(update=split)


class Upstream:
    """A connection pool to one deployment. The session is made on first use, inside the
    event loop that will run it (aiohttp requires one; the Gateway is built before it)."""

    def __init__(self, dep: RemoteDeployment, headers: dict[str, str]) -> None:
        self.base_url, self.headers = dep.base_url, headers
        # The router owns retries and per-attempt deadlines; the pool only bounds
        # connections and the time to open one.
        self.limit = dep.max_parallel or 1000
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(5.0, dep.timeout_s),
                                             sock_read=dep.timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit, limit_per_host=self.limit),
                timeout=self.timeout, trust_env=False)
        return self._session

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST `body`; the decoded JSON reply. Raises UpstreamError for anything else."""
        try:
            async with self._post(path, body) as reply:
                data = await reply.read()
                _check(reply, data)
        except TRANSPORT_ERRORS as exc:
            raise transport_error(exc, f"{self.base_url} unreachable") from None
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamError(502, "upstream sent a malformed JSON body",
                                retryable=True) from None

    @asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[str]]:
        """POST `body` and yield the reply's lines (decoded, without line endings); the
        connection is released when the block ends, read to the end or not."""
        try:
            reply = await self._post(path, body)
        except TRANSPORT_ERRORS as exc:
            raise transport_error(exc, f"{self.base_url} unreachable") from None
        try:
            if reply.status >= 300:
                try:
                    data = await reply.read()
                except TRANSPORT_ERRORS as exc:
                    raise transport_error(exc, f"{self.base_url} broke off") from None
                _check(reply, data)
            yield _lines(reply)
        finally:
            reply.release()

    def _post(self, path: str, body: dict[str, Any]):
        return self.session().post(self.base_url + path, data=json_bytes(body),
                                   headers={**self.headers, "content-type": "application/json"},
                                   allow_redirects=False)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _check(reply: aiohttp.ClientResponse, data: bytes) -> None:
    """Raise for anything but a 2xx reply; a redirect is a failed deployment, not a hop."""
    if 300 <= reply.status < 400:
        raise UpstreamError(502, f"upstream answered HTTP {reply.status} (a redirect); "
                                 "redirects are not followed", retryable=True)
    if reply.status >= 400:
        raise status_error(reply.status, data.decode(errors="replace"),
                           reply.headers.get("retry-after"))


async def _lines(reply: aiohttp.ClientResponse) -> AsyncIterator[str]:
    try:
        async for line in reply.content:
            yield line.decode(errors="replace").rstrip("\r\n")
    except TRANSPORT_ERRORS as exc:
        raise transport_error(exc, "upstream stream broke") from None


def transport_error(exc: Exception, what: str) -> UpstreamError:
    timeout = isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError)
    return UpstreamError(504 if timeout else 502,
                         f"{what}: {type(exc).__name__}: {exc}".rstrip(": "), retryable=True)
