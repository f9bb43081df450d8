"""Anthropic Messages API behind the OpenAI chat schema, translated both ways.

Requests: system/developer messages become `system`; assistant `tool_calls` become `tool_use`
blocks; `tool` messages become `tool_result` blocks in a user turn; tools and tool_choice map
to Anthropic's shapes. Responses and stream events (`content_block_*`, `message_delta`) map
back to OpenAI messages and chunks, tool calls included.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from codeplane.gateway.providers.base import Call, ProviderServices, Reply, UpstreamError, Usage
from codeplane.gateway.providers.http import RemoteDeployment, Upstream

VERSION = "2023-06-01"
PATH = "/v1/messages"
STOP = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
        "tool_use": "tool_calls", "pause_turn": "stop", "refusal": "content_filter"}


class AnthropicDeployment(RemoteDeployment):
    """`provider = "anthropic"`: the Messages API, at Anthropic unless `base_url` says."""

    provider: Literal["anthropic"]
    base_url: str = "https://api.anthropic.com"
    capabilities: ClassVar[tuple[str, ...]] = ("chat", "tools")


class AnthropicProvider:
    def __init__(self, dep: AnthropicDeployment, services: ProviderServices) -> None:
        self.dep = dep
        key = dep.api_key()
        self.upstream = Upstream(dep, {"anthropic-version": VERSION,
                                       **({"x-api-key": key} if key else {})})

    async def request(self, call: Call) -> Reply:
        reply = await self.upstream.post_json(PATH, to_anthropic(call, self.dep.upstream_model))
        try:
            body = from_anthropic(reply, call.raw["model"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamError(502, f"malformed Anthropic response: {exc}",
                                retryable=True) from None
        return Reply(body, Usage.of(body["usage"]))

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any] | Usage]:
        body = {**to_anthropic(call, self.dep.upstream_model), "stream": True}
        async with self.upstream.stream(PATH, body) as lines:
            translator = _StreamTranslator(call)
            async for event in _events(lines):
                for chunk in translator.feed(event):
                    yield chunk
                if translator.done:
                    return
            raise UpstreamError(502, "Anthropic stream ended without message_stop "
                                     "(connection cut)", retryable=True)

    async def aclose(self) -> None:
        await self.upstream.aclose()


def to_anthropic(call: Call, model: str) -> dict[str, Any]:
    if call.kind != "chat":
        raise UpstreamError(400, f"provider anthropic serves chat completions only, not "
                                 f"/v1/{call.kind}", retryable=False, param="model")
    raw = call.raw
    system, messages = [], []
    for msg in raw["messages"]:
        role, content = msg.get("role"), msg.get("content")
        if role in ("system", "developer"):
            system.append(_text(content))
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id"),
                     "content": _text(content)}
            _append(messages, "user", [block])
        elif role == "assistant":
            blocks = [{"type": "text", "text": _text(content)}] if _text(content) else []
            for tc in msg.get("tool_calls") or []:
                fn = tc.get("function", {})
                args = fn.get("arguments") or "{}"
                blocks.append({"type": "tool_use", "id": tc.get("id"), "name": fn.get("name"),
                               "input": json.loads(args) if isinstance(args, str) else args})
            _append(messages, "assistant", blocks)
        else:
            _append(messages, "user", [{"type": "text", "text": _text(content)}])
    body: dict[str, Any] = {
        "model": model, "messages": messages,
        "max_tokens": raw.get("max_completion_tokens") or raw.get("max_tokens") or 1024}
    if system:
        body["system"] = "\n\n".join(system)
    for key in ("temperature", "top_p"):
        if raw.get(key) is not None:
            body[key] = raw[key]
    if raw.get("stop"):
        body["stop_sequences"] = [raw["stop"]] if isinstance(raw["stop"], str) else raw["stop"]
    if raw.get("tools"):
        body["tools"] = [{"name": t["function"]["name"],
                          "description": t["function"].get("description", ""),
                          "input_schema": t["function"].get("parameters") or {"type": "object"}}
                         for t in raw["tools"]]
        choice = raw.get("tool_choice")
        if choice == "required":
            body["tool_choice"] = {"type": "any"}
        elif choice == "none":
            body["tool_choice"] = {"type": "none"}
        elif isinstance(choice, dict):
            body["tool_choice"] = {"type": "tool", "name": choice["function"]["name"]}
    return body


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _append(messages: list[dict], role: str, blocks: list[dict]) -> None:
    """Anthropic wants strictly alternating roles: merge consecutive same-role turns."""
    if messages and messages[-1]["role"] == role:
        messages[-1]["content"].extend(blocks)
    else:
        messages.append({"role": role, "content": blocks})


def from_anthropic(body: dict[str, Any], model: str) -> dict[str, Any]:
    text, calls = "", []
    for block in body["content"]:
        if block["type"] == "text":
            text += block["text"]
        elif block["type"] == "tool_use":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input") or {})}})
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    usage = body.get("usage") or {}
    prompt, completion = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
    return {"id": f"chatcmpl-{body.get('id', uuid.uuid4().hex)}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": STOP.get(body.get("stop_reason"), "stop")}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            raise UpstreamError(502, f"Anthropic sent a malformed event: {line[:120]!r}",
                                retryable=True) from None
        if not isinstance(event, dict) or "type" not in event:
            raise UpstreamError(502, f"Anthropic sent a malformed event: {line[:120]!r}",
                                retryable=True)
        yield event


class _StreamTranslator:
    """Anthropic stream events -> OpenAI chat chunks."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": call.raw["model"]}
        self.tool_index: dict[int, int] = {}  # Anthropic block index -> OpenAI tool index
        self.prompt_tokens = 0
        self.done = False

    def _chunk(self, delta: dict, finish: str | None = None) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any] | Usage]:
        kind = event["type"]
        if kind == "message_start":
            usage = event.get("message", {}).get("usage", {})
            self.prompt_tokens = usage.get("input_tokens", 0)
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            block = event["content_block"]
            index = self.tool_index.setdefault(event["index"], len(self.tool_index))
            return [self._chunk({"tool_calls": [{
                "index": index, "id": block["id"], "type": "function",
                "function": {"name": block["name"], "arguments": ""}}]})]
        if kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                return [self._chunk({"content": delta["text"]})]
            if delta["type"] == "input_json_delta":
                return [self._chunk({"tool_calls": [{
                    "index": self.tool_index[event["index"]],
                    "function": {"arguments": delta["partial_json"]}}]})]
            return []
        if kind == "message_delta":
            completion = event.get("usage", {}).get("output_tokens", 0)
            usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                     "total_tokens": self.prompt_tokens + completion}
            finish = STOP.get(event.get("delta", {}).get("stop_reason"), "stop")
            out: list[dict[str, Any] | Usage] = [Usage(**usage), self._chunk({}, finish)]
            if self.call.include_usage:
                out.append({**self.base, "choices": [], "usage": usage})
            return out
        if kind == "message_stop":
            self.done = True
        if kind == "error":
            err = event.get("error", {})
            raise UpstreamError(502, f"Anthropic error mid-stream: {err.get('message', err)}",
                                retryable=True)
        return []
