"""Cost of a forced tool call (`tool_choice: "required"`): lazy grammar gate vs llama.cpp's
grammar sampler over the whole vocabulary, same prompt, greedy, KV prefix cached.

    flock /tmp/codeplane-cpu.lock python bench/grammar.py [--model code-medium] [--task read|create] [--max-tokens 48]

The tools are the agent's 11 tool schemas, so the grammar is as large as real agent turns use.
"""

from __future__ import annotations

import argparse
import time

from llama_cpp import LlamaGrammar

from codeplane.agent.tools import default_toolset
from codeplane.config import load_settings
from codeplane.models.engine import Decoding, LocalModel
from codeplane.models.local_openai import tool_call_grammar
from codeplane.models.registry import ModelRegistry

TASKS = {  # a short call, and one whose arguments are a long string (code)
    "read": "Read the file src/app.py and fix the bug in add().",
    "create": "Create the file src/stats.py with functions mean, median and mode, with "
              "docstrings.",
}


def full_grammar(model: LocalModel, tokens: list[int], gbnf: str, limit: int) -> list[int]:
    """llama-cpp-python's own path: the grammar sampler chained in front of greedy choice."""
    out: list[int] = []
    for token in model.llama.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0,
                                      grammar=LlamaGrammar.from_string(gbnf, verbose=False)):
        if token in model.stop_ids or len(out) == limit:
            break
        out.append(token)
    return out


def measure(model: LocalModel, task: str, limit: int) -> None:
    tools = default_toolset().schemas()
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": task}]
    tokens = model.chat_tokens(messages, tools)
    gbnf = tool_call_grammar(tools, "required")
    model.generate(tokens, Decoding(max_tokens=1))  # cache the prompt for every variant
    runs = {
        "free (no grammar)": lambda: model.generate(tokens, Decoding(max_tokens=limit)).text,
        "lazy grammar gate": lambda: model.generate(
            tokens, Decoding(max_tokens=limit, grammar=gbnf)).text,
        "full-vocab grammar": lambda: model.llama.detokenize(
            full_grammar(model, tokens, gbnf, limit)).decode(),
    }
    texts = {}
    for label, run in runs.items():
        start = time.perf_counter()
        texts[label] = run()
        print(f"{label:20s} {time.perf_counter() - start:7.2f} s  {texts[label][:70]!r}")
    print("gate output == full grammar output:",
          texts["lazy grammar gate"] == texts["full-vocab grammar"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="code-medium")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--task", choices=sorted(TASKS), default="read")
    args = parser.parse_args()
    settings = load_settings(None)
    model = LocalModel(ModelRegistry(settings).get(args.model), settings)  # its internals
    try:
        measure(model, TASKS[args.task], args.max_tokens)
    finally:
        model.llama.close()


if __name__ == "__main__":
    main()
