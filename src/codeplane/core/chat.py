"""The model seam: what the agent (or an RL trainer) needs from a chat model, and nothing more.

`ChatModel.complete(messages, tools, sampling, cancel) -> Turn`. Implementations: `HttpChatModel`
below, for any OpenAI-compatible endpoint (the CLI, RL rollouts with `[sampler] kind = "http"`),
the in-process gateway client (`gateway/chat.py`, used by server runs: the caller's key,
admission and priority, no loopback call) and the RL samplers (`rl/policy.py`, `rl/adapter.py`:
token ids, logprobs and a policy version on every Turn). The HTTP client and the gateway
client fold the same OpenAI stream chunks with `TurnBuilder`, so a reply means the same thing
whichever way it arrived. The HTTP client lives here, not in a compartment: it is no gateway
policy and no agent logic, only the wire.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from codeplane.core.http import api_client
from codeplane.core.sse import ChunkReader, StreamError


class ModelError(RuntimeError):
    """The model call failed; `code` is the OpenAI error code when one is known (the loop
    reacts to "context_length_exceeded")."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class Cancelled(Exception):
    """The run was cancelled while a model reply was streaming."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 1024
    temperature: float = 0.0
    tool_choice: str = "auto"  # "auto" | "required" | "none"

    def shown(self, tools: list[dict]) -> list[dict]:
        """The tools the model is shown: none on a turn asked without tools, as codeplane
        serve renders such a request (`models/local_openai.py`)."""
        return tools if self.tool_choice != "none" else []


@dataclass
class Turn:
    """One assistant reply: the message (role, content, tool_calls), why it stopped, token
    usage, and per-token logprobs when the model reports them. A training policy also returns
    the exact token ids it was prompted with and sampled, and the policy version that sampled
    them, so a trainer scores the same tokens the sampler saw (no re-tokenisation drift)."""

    message: dict[str, Any]
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)  # token counts; "adapter"
    logprobs: list[float] | None = None
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None
    policy_version: int | None = None


class ChatModel(Protocol):
    name: str

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        """One reply. Raises ModelError on failure, Cancelled once `cancel` is set."""

    def describe(self) -> dict[str, Any]:
        """What a transcript records about the model (name, how it is reached; no secret)."""

    def close(self) -> None:
        """Release connections."""


class TurnBuilder:
    """Folds OpenAI chat-completion stream chunks into one Turn: content concatenated, tool
    calls accumulated by index, the last finish reason and usage. A chunk of the wrong shape
    raises ModelError instead of an AttributeError deep in a run."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, int] = {}
        self.logprobs: list[float] = []

    def add(self, chunk: dict[str, Any]) -> None:
        try:
            if chunk.get("usage"):
                self.usage = dict(chunk["usage"])
            for choice in chunk.get("choices") or []:
                self._choice(choice)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"model stream sent a chunk of the wrong shape ({exc}): "
                             f"{str(chunk)[:200]}", "bad_stream") from None

    def _choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        self.content.append(delta.get("content") or "")
        for part in delta.get("tool_calls") or []:
            call = self.calls.setdefault(int(part.get("index", len(self.calls))), {
                "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            fn = part.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
        for token in (choice.get("logprobs") or {}).get("content") or []:
            self.logprobs.append(float(token["logprob"]))
        self.finish = choice.get("finish_reason") or self.finish

    def turn(self) -> Turn:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        usage = {k: int(v) for k, v in self.usage.items() if isinstance(v, int)}
        if isinstance(adapter := self.usage.get("adapter"), str):  # a local adapter model's
            usage["adapter"] = adapter  # version (gateway/providers/local.py), for the events
        return Turn(message, self.finish, usage, self.logprobs or None)


def _http_error(resp: httpx.Response) -> ModelError:
    try:
        err = resp.json()["error"]
        message, code = err.get("message"), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = resp.text[:500], None
    return ModelError(f"model server returned {resp.status_code}: {message}", code)


def _assemble(lines: Iterator[str], cancel: threading.Event | None) -> Turn:
    """Fold an OpenAI chat-completion SSE stream into one Turn, checking `cancel` before
    each line (keep-alive comments included). A malformed, erroring or cut stream raises
    ModelError: a cut reply is not an answer (the rules live in `core/sse`, shared with the
    gateway)."""
    reader, turn = ChunkReader(), TurnBuilder()
    try:
        for line in lines:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            chunk = reader.feed(line)
            if reader.done:
                break
            if chunk is not None:
                turn.add(chunk)
        reader.end()
    except StreamError as exc:
        raise ModelError(f"model stream {exc.message}", exc.code) from None
    return turn.turn()


class HttpChatModel:
    """A `ChatModel` over any OpenAI-compatible endpoint (`codeplane serve`, a provider):
    what the CLI uses. Server runs use the in-process gateway client instead."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 900.0) -> None:
        self.base_url, self.name = base_url.rstrip("/"), model
        self.http = api_client(api_key, timeout, base_url=self.base_url)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "via": "http", "base_url": self.base_url}

    def listing(self) -> dict[str, Any]:
        """This model's entry in the server's `/v1/models` (empty: not listed, or a server
        without the route): what a server says of a model beyond the API, such as the agent
        setup a trained model was registered with (codeplane serve's `agent_setup`)."""
        try:
            resp = self.http.get("/models")
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        if resp.status_code == 404:
            return {}
        if resp.status_code >= 400:
            raise _http_error(resp)
        return next((m for m in resp.json().get("data") or [] if m.get("id") == self.name), {})

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        """One chat completion, streamed so that `cancel` can end it between chunks: leaving
        the stream closes the connection, and the server stops generating (a run cancelled
        mid-reply no longer keeps the CPU busy until the reply is complete)."""
        body = {"model": self.name, "messages": messages, "tools": tools,
                "tool_choice": sampling.tool_choice, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with self.http.stream("POST", "/chat/completions", json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _http_error(resp)
                return _assemble(resp.iter_lines(), cancel)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: httpx.TransportError) -> ModelError:
        return ModelError(f"cannot reach the model server at {self.base_url} ({exc}); start "
                          "it with `codeplane serve` or pass --base-url", "unreachable")

    def close(self) -> None:
        self.http.close()
