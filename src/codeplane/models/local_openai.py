"""The local engine speaking the OpenAI schema: request models in, response/chunk dicts out.

`chat` and `completions` are engine jobs (`models/jobs.py`): they run in the model's worker
process. With `stream`, each OpenAI chunk dict is emitted to the caller as soon as it is
known.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from codeplane.core.schemas import ChatCompletionRequest, CompletionRequest, stop_list
from codeplane.models.engine import Decoding, Generation, LocalModel, Unsupported
from codeplane.models.jobs import JobContext
from codeplane.models.toolcalls import ToolCall, parse_tool_calls, tool_names

Emit = Callable[[dict[str, Any]], None]
_OPENERS = ("<tool_call>", "```", "{", "[")


def chat(ctx: JobContext, req: ChatCompletionRequest, stream: bool
         ) -> tuple[dict[str, Any], Generation]:
    """One /v1/chat/completions answer (the engine job `openai.chat`)."""
    model, emit = ctx.model, ctx.emit if stream else None
    tools = req.tools if req.tool_choice != "none" else None
    sampling = Decoding(
        max_tokens=req.max_completion_tokens or req.max_tokens or 1024,
        temperature=req.temperature, top_p=req.top_p, stop=stop_list(req.stop),
        seed=req.seed, grammar=tool_call_grammar(tools, req.tool_choice),
    )
    tokens = model.chat_tokens(req.messages_json(), tools)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    chunks = _ChatStream(emit, rid, created, req.model, holdback=bool(tools)) if emit else None
    gen = model.generate(tokens, sampling, ctx.cancel, chunks.text if chunks else None)
    content, calls = parse_tool_calls(gen.text, tool_names(tools)) if tools else (gen.text, [])
    finish = "tool_calls" if calls else _finish(gen)
    if chunks:
        chunks.finish(content, calls, finish)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    elif message["content"] is None:
        message["content"] = ""
    body = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage(gen)}
    return body, gen


def completions(ctx: JobContext, req: CompletionRequest, stream: bool
                ) -> tuple[dict[str, Any], Generation]:
    """One /v1/completions answer, a choice per prompt (the engine job `openai.completions`;
    the caller allows `stream` with one prompt only). The generation returned is the first
    prompt's."""
    emit = ctx.emit if stream else None
    bodies = [_choice(ctx.model, req, p, i, ctx.cancel, emit)
              for i, p in enumerate(req.prompts())]
    first, gen = bodies[0]
    if len(bodies) > 1:
        first = {**first, "choices": [b["choices"][0] for b, _ in bodies],
                 "usage": _sum_usage([b["usage"] for b, _ in bodies])}
    return first, gen


def _choice(model: LocalModel, req: CompletionRequest, prompt: str, index: int,
            cancel: threading.Event, emit: Emit | None = None) -> tuple[dict, Generation]:
    """One choice of /v1/completions; FIM when the request carries a suffix."""
    if req.suffix is not None:
        tokens = model.fim_tokens(prompt, req.suffix)
    else:
        bos = model.llama.token_bos()
        tokens = ([bos] if bos >= 0 and _adds_bos(model) else []) + model.tokenize(prompt)
    sampling = Decoding(max_tokens=req.max_tokens, temperature=req.temperature,
                        top_p=req.top_p, stop=stop_list(req.stop), seed=req.seed,
                        logprobs=req.logprobs is not None)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def on_text(delta: str) -> None:
        assert emit is not None
        emit({"id": rid, "object": "text_completion", "created": created, "model": req.model,
              "choices": [{"index": index, "text": delta, "finish_reason": None,
                           "logprobs": None}]})

    if req.echo and emit:
        on_text(prompt)
    gen = model.generate(tokens, sampling, cancel, on_text if emit else None)
    text = (prompt if req.echo else "") + gen.text
    logprobs = {"token_logprobs": gen.token_logprobs} if gen.token_logprobs is not None else None
    choice = {"index": index, "text": text, "finish_reason": _finish(gen), "logprobs": logprobs}
    if emit:
        emit({"id": rid, "object": "text_completion", "created": created, "model": req.model,
              "choices": [{**choice, "text": ""}]})
    body = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [choice], "usage": usage(gen)}
    return body, gen


def usage(gen: Generation) -> dict[str, Any]:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


def _sum_usage(usages: list[dict]) -> dict:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    total = {k: sum(u[k] for u in usages) for k in keys}
    total["prompt_tokens_details"] = {
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return total


def tool_call_grammar(tools: list[dict] | None, choice: str | dict | None) -> str | None:
    """GBNF forcing a `<tool_call>` when the client requires one (tool_choice required/named).

    Small models often answer in prose when a call is mandatory; constraining decoding with
    llama.cpp's grammar sampler makes the contract hold instead of hoping it does."""
    if not tools or choice in (None, "auto", "none"):
        return None
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    wanted = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    options = []
    for tool in tools:
        fn = tool.get("function", tool)
        if wanted and fn.get("name") != wanted:
            continue
        options.append({"type": "object", "required": ["name", "arguments"],
                        "properties": {"name": {"const": fn["name"]},
                                       "arguments": fn.get("parameters") or {"type": "object"}}})
    if not options:
        raise Unsupported(f"tool_choice names {wanted!r}, which is not among the tools")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    grammar = json_schema_to_gbnf(json.dumps(schema))
    grammar = grammar.replace("root ::=", "call ::=", 1)
    return 'root ::= "<tool_call>\\n" call "\\n</tool_call>"\n' + grammar


def _finish(gen: Generation) -> str:
    return "length" if gen.finish_reason == "length" else "stop"


def _adds_bos(model: LocalModel) -> bool:
    return model.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"


class _ChatStream:
    """Emits chat chunks. With tools, text from the first thing that may open a tool call
    on is held back until the end, when it is known whether it was a call or prose."""

    def __init__(self, emit: Emit, rid: str, created: int, model: str, holdback: bool) -> None:
        self.emit, self.holdback = emit, holdback
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": model}
        self.seen = ""
        self.shown = ""
        self.held = False  # an opener was seen: the rest waits for `finish`
        self._delta({"role": "assistant", "content": ""})

    def text(self, delta: str) -> None:
        self.seen += delta
        if not self.holdback:
            self._show(delta)
            return
        if self.held:
            return
        # Only the unshown tail (plus an opener's length before it) can hold a new opener,
        # so long answers are not rescanned on every token.
        start = max(0, len(self.shown) - len(_OPENERS[0]))
        found = [i for i in (self.seen.find(o, start) for o in _OPENERS) if i != -1]
        self.held = bool(found)
        cut = min(found, default=len(self.seen) - _partial_opener(self.seen))
        if cut > len(self.shown):
            self._show(self.seen[len(self.shown):cut])

    def finish(self, content: str, calls: list[ToolCall], reason: str) -> None:
        if content.startswith(self.shown) and len(content) > len(self.shown):
            self._show(content[len(self.shown):])
        for index, call in enumerate(calls):
            self._delta({"tool_calls": [{"index": index, **call.to_openai()}]})
        self.emit({**self.base, "choices": [{"index": 0, "delta": {}, "finish_reason": reason,
                                             "logprobs": None}]})

    def _show(self, text: str) -> None:
        if text:
            self.shown += text
            self._delta({"content": text})

    def _delta(self, delta: dict[str, Any]) -> None:
        self.emit({**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                             "logprobs": None}]})


def _partial_opener(text: str) -> int:
    """Length of a tail of `text` that could grow into `<tool_call>`."""
    tag = "<tool_call>"
    return next((n for n in range(min(len(tag), len(text)), 0, -1)
                 if text.endswith(tag[:n])), 0)
