"""OpenAI request bodies. Unknown fields are ignored, as OpenAI-compatible servers do.

Every field is bounded, and `WireModel` refuses, anywhere in a body, lone UTF-16 surrogates
(JSON may carry them, `"\\ud800"`, but they have no UTF-8 form, so the first `.encode()` deep
in a handler would turn a client's bad input into a 500) and nesting deeper than `MAX_DEPTH`
(which would reach a recursion limit somewhere downstream).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

MAX_TOKENS = 1 << 20  # more than any context window; bounds what a client can ask for
INT64 = 2**63 - 1
# Deeper than any request needs (a tool's JSON schema is a few levels), and far below what
# downstream encoders take (orjson refuses past 255 levels).
MAX_DEPTH = 64


def _problem(value: Any) -> str | None:
    """What makes a parsed body unusable, if anything: a lone surrogate, or nesting past
    `MAX_DEPTH`. A loop over an explicit stack, not recursion: a 900-deep body reaches
    Python's recursion limit in a recursive walk (a 500), while JSON's own parser takes it."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return ("text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                        "escape), which is not valid Unicode")
        elif isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                return f"the body is nested more than {MAX_DEPTH} levels deep"
            children = [*item, *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


class WireModel(BaseModel):
    """Base of request bodies: a 400 for text that cannot be encoded or nesting too deep,
    before any handler."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        problem = _problem(data)
        if problem:
            raise ValueError(problem)
        return data


class _Request(WireModel):
    model_config = ConfigDict(extra="ignore")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=512)
    name: str | None = Field(None, max_length=512)

    @field_validator("content")
    @classmethod
    def _parts(cls, value: str | list[dict[str, Any]] | None):
        """Content parts are read as `{"type": "text", "text": str}` downstream."""
        if isinstance(value, list):
            if len(value) > 1024:
                raise ValueError("at most 1024 content parts")
            if any(not isinstance(p.get("text", ""), str) for p in value):
                raise ValueError("a content part's text must be a string")
        return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(_Request):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(0.7, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=-INT64, le=INT64)

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, value: str | dict | None) -> str | dict | None:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError("must be 'none', 'auto', 'required' or a function object")
        return value

    def messages_json(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_Request):
    model: str
    prompt: str | list[str]
    suffix: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    temperature: float = Field(0.7, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=16)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    seed: int | None = Field(None, ge=-INT64, le=INT64)

    @field_validator("prompt")
    @classmethod
    def _some_prompts(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not 1 <= len(value) <= 2048:
            raise ValueError("a list of prompts must hold 1-2048 strings")
        return value

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
