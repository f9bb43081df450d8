"""OpenAI-compatible upstreams (OpenAI, vLLM, llama.cpp server, LiteLLM, ...) over httpx.

Only known request fields pass (`FORWARDED`): a field a paid upstream bills for or acts on
(`n`, `best_of`, `service_tier`, `store`, tools the upstream runs itself, ...) never reaches it
because a client typed it. `model` becomes the upstream's name and, for streams, usage
reporting is switched on so token limits see real counts. A stream must end with `[DONE]`;
a cut connection, a malformed chunk or an in-band error becomes an UpstreamError, which the
router turns into an explicit error event instead of a silent truncation.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from codeplane.core.sse import StreamError, aiter_chunks
from codeplane.gateway.config import DeploymentConfig
from codeplane.gateway.providers.base import Call, UpstreamError, status_error

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
_SAMPLING = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
             "seed", "presence_penalty", "frequency_penalty"}
FORWARDED = {
    "chat": _SAMPLING | {"messages", "tools", "tool_choice", "parallel_tool_calls",
                         "max_completion_tokens", "response_format"},
    "completions": _SAMPLING | {"prompt", "suffix", "logprobs", "echo"},
    "embeddings": {"model", "input", "encoding_format", "dimensions"},
}


def http_client(dep: DeploymentConfig) -> httpx.AsyncClient:
    # The router owns retries and timeouts per attempt; the client only pools connections.
    limits = httpx.Limits(max_connections=dep.max_parallel or 1000,
                          max_keepalive_connections=dep.max_parallel or 1000)
    timeout = httpx.Timeout(dep.timeout_s, connect=min(5.0, dep.timeout_s))
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def transport_error(exc: Exception, what: str) -> UpstreamError:
    return UpstreamError(502 if not isinstance(exc, httpx.TimeoutException) else 504,
                         f"{what}: {type(exc).__name__}: {exc}".rstrip(": "), retryable=True)


class OpenAIProvider:
    def __init__(self, dep: DeploymentConfig) -> None:
        self.dep = dep
        self.client = http_client(dep)
        key = os.environ.get(dep.api_key_env, "") if dep.api_key_env else ""
        self.headers = {"authorization": f"Bearer {key}"} if key else {}

    def _body(self, call: Call) -> dict[str, Any]:
        allowed = FORWARDED[call.kind]
        body = {k: v for k, v in call.raw.items() if k in allowed}
        body["model"] = self.dep.upstream_model
        if call.stream and call.kind != "embeddings":
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        return body

    async def request(self, call: Call) -> dict[str, Any]:
        url = self.dep.base_url + PATHS[call.kind]
        try:
            reply = await self.client.post(url, json=self._body(call), headers=self.headers)
        except httpx.HTTPError as exc:
            raise transport_error(exc, f"{self.dep.base_url} unreachable") from None
        if reply.status_code >= 400:
            raise status_error(reply.status_code, reply.text, reply.headers.get("retry-after"))
        try:
            body = reply.json()
        except ValueError:
            raise UpstreamError(502, "upstream sent a malformed JSON body",
                                retryable=True) from None
        if not isinstance(body, dict) or "error" in body:
            raise UpstreamError(502, f"upstream error: {str(body)[:300]}", retryable=True)
        body["model"] = call.raw.get("model", body.get("model"))
        return body

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any]]:
        url = self.dep.base_url + PATHS[call.kind]
        request = self.client.build_request("POST", url, json=self._body(call),
                                            headers=self.headers)
        async with open_stream(self.client, request, self.dep.base_url) as reply:
            async for chunk in _sse_chunks(reply):
                chunk["model"] = call.raw.get("model", chunk.get("model"))
                if not call.include_usage and not chunk.get("choices") and "usage" in chunk:
                    call.extra["usage"] = chunk["usage"]  # we asked for it; client did not
                    continue
                if chunk.get("usage"):
                    call.extra["usage"] = chunk["usage"]
                yield chunk

    async def aclose(self) -> None:
        await self.client.aclose()


@asynccontextmanager
async def open_stream(client: httpx.AsyncClient, request: httpx.Request,
                      base_url: str) -> AsyncIterator[httpx.Response]:
    """Send a streaming request; transport failures and error statuses become UpstreamError
    (before the first token, so the router may retry elsewhere). Always closes the reply."""
    try:
        reply = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise transport_error(exc, f"{base_url} unreachable") from None
    try:
        if reply.status_code >= 400:
            text = (await reply.aread()).decode(errors="replace")
            raise status_error(reply.status_code, text, reply.headers.get("retry-after"))
        yield reply
    finally:
        await reply.aclose()


async def _sse_chunks(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    try:
        async for chunk in aiter_chunks(reply.aiter_lines()):
            yield chunk
    except StreamError as exc:
        raise UpstreamError(502, f"upstream stream {exc.message}", retryable=True) from None
    except httpx.HTTPError as exc:
        raise transport_error(exc, "upstream stream broke") from None
