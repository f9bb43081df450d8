"""OpenAI-compatible upstreams (OpenAI, vLLM, llama.cpp server, LiteLLM, ...) over HTTP.

Only known request fields pass (`FORWARDED`): a field a paid upstream bills for or acts on
(`n`, `best_of`, `service_tier`, `store`, tools the upstream runs itself, ...) never reaches it
because a client typed it. `model` becomes the upstream's name and, for streams, usage
reporting is switched on so token limits see real counts. A stream must end with `[DONE]`;
a cut connection, a malformed chunk or an in-band error becomes an UpstreamError, which the
router turns into an explicit error event instead of a silent truncation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from codeplane.core.http import api_headers
from codeplane.core.sse import StreamError, aiter_chunks
from codeplane.gateway.providers.base import Call, ProviderServices, Reply, UpstreamError, Usage
from codeplane.gateway.providers.http import RemoteDeployment, Upstream

PATHS = {"chat": "/chat/completions", "completions": "/completions", "embeddings": "/embeddings"}
_SAMPLING = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop",
             "seed", "presence_penalty", "frequency_penalty"}
FORWARDED = {
    "chat": _SAMPLING | {"messages", "tools", "tool_choice", "parallel_tool_calls",
                         "max_completion_tokens", "response_format"},
    "completions": _SAMPLING | {"prompt", "suffix", "logprobs", "echo"},
    "embeddings": {"model", "input", "encoding_format", "dimensions"},
}


class OpenAIDeployment(RemoteDeployment):
    """`provider = "openai"`: any OpenAI-compatible server at `base_url`."""

    provider: Literal["openai"]
    capabilities: ClassVar[tuple[str, ...]] = ("chat", "tools", "completion", "embeddings")


class OpenAIProvider:
    def __init__(self, dep: OpenAIDeployment, services: ProviderServices) -> None:
        self.dep = dep
        key = dep.api_key()
        self.upstream = Upstream(dep, api_headers(key))

    def _body(self, call: Call) -> dict[str, Any]:
        allowed = FORWARDED[call.kind]
        body = {k: v for k, v in call.raw.items() if k in allowed}
        body["model"] = self.dep.upstream_model
        if call.stream and call.kind != "embeddings":
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        return body

    async def request(self, call: Call) -> Reply:
        body = await self.upstream.post_json(PATHS[call.kind], self._body(call))
        if not isinstance(body, dict) or "error" in body:
            raise UpstreamError(502, f"upstream error: {str(body)[:300]}", retryable=True)
        body["model"] = call.raw.get("model", body.get("model"))
        return Reply(body, Usage.of(body.get("usage")))

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any] | Usage]:
        async with self.upstream.stream(PATHS[call.kind], self._body(call)) as lines:
            async for chunk in _sse_chunks(lines):
                chunk["model"] = call.raw.get("model", chunk.get("model"))
                if usage := Usage.of(chunk.get("usage")):
                    yield usage
                if not call.include_usage and not chunk.get("choices") and "usage" in chunk:
                    continue  # we asked for it; the client did not
                yield chunk

    async def aclose(self) -> None:
        await self.upstream.aclose()


async def _sse_chunks(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for chunk in aiter_chunks(lines):
            yield chunk
    except StreamError as exc:
        raise UpstreamError(502, f"upstream stream {exc.message}", retryable=True) from None
