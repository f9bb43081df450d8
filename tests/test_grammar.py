"""Forced tool calls: the lazy grammar gate gives llama.cpp's full-grammar result, cheaply."""

from __future__ import annotations

import json

from conftest import WEATHER_TOOL
from llama_cpp import LlamaGrammar

from codeplane.models.engine import Decoding
from codeplane.models.local_openai import tool_call_grammar
from codeplane.models.toolcalls import parse_tool_calls

TOOLS = [WEATHER_TOOL, {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]


def test_greedy_output_equals_the_full_grammar_sampler(local_model):
    gbnf = tool_call_grammar(TOOLS, "required")

    def both(model):
        tokens = model.chat_tokens(MESSAGES, TOOLS)
        gated = model.generate(tokens, Decoding(max_tokens=40, grammar=gbnf)).text
        full = []
        for token in model.llama.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0,
                                          grammar=LlamaGrammar.from_string(gbnf,
                                                                           verbose=False)):
            if token in model.stop_ids or len(full) == 40:
                break
            full.append(token)
        return gated, model.llama.detokenize(full).decode()

    gated, full = both(local_model)
    assert gated == full
    assert gated.startswith("<tool_call>\n{")  # the prompt alone would get a chatty reply


def test_sampled_forced_calls_are_well_formed(local_model):
    gbnf = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}})

    def sample(model, seed):
        tokens = model.chat_tokens(MESSAGES, TOOLS)
        return model.generate(tokens, Decoding(max_tokens=80, temperature=1.0, seed=seed,
                                               grammar=gbnf))

    complete = 0
    for seed in (1, 2, 3):
        gen = sample(local_model, seed)
        if gen.finish_reason == "length":
            continue  # cut off mid-argument; only complete calls can be checked
        complete += 1
        _, calls = parse_tool_calls(gen.text, {"get_weather", "read_file"})
        assert [c.name for c in calls] == ["get_weather"], gen.text
        assert isinstance(json.loads(calls[0].arguments), dict)
    assert complete >= 2
