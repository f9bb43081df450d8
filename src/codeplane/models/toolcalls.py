"""Tool calls in and out of plain-text models.

In: tools go into the prompt through the model's own chat template when it knows about tools
(Qwen2.5's does); otherwise a system note describes them in the Hermes `<tool_call>` format.

Out: small models are inconsistent, so parsing is lenient. Accepted, in this order:
`<tool_call>{json}</tool_call>` blocks (closing tag optional at the end), fenced ```json blocks,
and bare JSON objects in the text. Each may hold one call or a list; several calls in one turn
become several tool calls. A call must name a declared tool, so JSON that merely appears in an
answer is not mistaken for a call.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"```[a-zA-Z]*\s*\n?(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    return {t.get("function", t).get("name", "") for t in tools or []} - {""}


def parse_tool_calls(text: str, allowed: set[str]) -> tuple[str, list[ToolCall]]:
    """Split model output into (remaining content, tool calls)."""
    for pattern in (_TAGGED, _FENCED):
        calls, spans = [], []
        for match in pattern.finditer(text):
            found = _calls_in(match.group(1), allowed)
            if found:
                calls.extend(found)
                spans.append(match.span())
        if calls:
            return _without(text, spans), calls
    calls, spans = _bare_calls(text, allowed)
    return _without(text, spans), calls


def _leftover(text: str) -> str:
    """Remaining content; brackets alone are debris of a call (`{{"name": ...}}` is a
    common small-model slip), not an answer."""
    return "" if not text.strip("{}[] \n\t") else text


def tools_system_note(tools: list[dict[str, Any]]) -> str:
    """Describe tools for chat templates that do not render them themselves."""
    specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return (
        "You may call functions to help with the request. Available functions:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "To call a function, reply with one line per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _calls_in(blob: str, allowed: set[str]) -> list[ToolCall]:
    value = _loads(blob.strip())
    if value is None:
        calls, _ = _bare_calls(blob, allowed)
        return calls
    return _as_calls(value, allowed)


def _bare_calls(text: str, allowed: set[str]) -> tuple[list[ToolCall], list[tuple[int, int]]]:
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    while (start := _next_open(text, pos)) != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            end = _balanced_end(text, start)
            value = _loads(text[start:end]) if end else None
            if value is None:
                pos = start + 1
                continue
        found = _as_calls(value, allowed)
        if found:
            calls.extend(found)
            spans.append((start, end))
        pos = end
    return calls, spans


def _balanced_end(text: str, start: int) -> int | None:
    """End of the bracketed span opening at `start`, skipping quoted strings (either quote
    style, since Python-literal calls are accepted too)."""
    depth, quote, escaped = 0, "", False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _next_open(text: str, pos: int) -> int:
    hits = [i for i in (text.find("{", pos), text.find("[", pos)) if i != -1]
    return min(hits) if hits else -1


def _loads(blob: str) -> Any:
    try:
        return json.loads(blob)
    except ValueError:
        pass
    try:  # Python-style dicts (single quotes, True/None) are a common small-model slip
        return ast.literal_eval(blob)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _as_calls(value: Any, allowed: set[str]) -> list[ToolCall]:
    if isinstance(value, list):
        calls = [c for item in value for c in _as_calls(item, allowed)]
        return calls if len(calls) == len(value) else []
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("tool_calls"), list):
        return _as_calls(value["tool_calls"], allowed)
    if isinstance(value.get("function"), dict):
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or name not in allowed:
        return []
    args = next((value[k] for k in ("arguments", "parameters", "args") if k in value), {})
    if isinstance(args, str):
        parsed = _loads(args)
        args = parsed if isinstance(parsed, dict) else {}
    if not isinstance(args, dict):
        return []
    return [ToolCall(name=name, arguments=json.dumps(args), id=f"call_{uuid.uuid4().hex[:24]}")]


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    for start, end in sorted(spans, reverse=True):
        text = text[:start] + text[end:]
    return _leftover(text).strip() if spans else text.strip()


def assistant_turn(text: str, tools: list[dict] | None, finish: str
                   ) -> tuple[dict[str, Any], str]:
    """The assistant message the product's local engine would return for `text`: tool calls
    parsed by its lenient parser, whatever remains as content."""
    content, calls = parse_tool_calls(text, tool_names(tools)) if tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
        message["content"] = content or None
    return message, "tool_calls" if calls else finish
