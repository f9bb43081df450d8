"""How long an RL episode's first prompt is under a run's config: the tokens the sampler
prefills and the trainer scores for every sample (its CPU time grows with them).

One episode of the config's first train task through the real path (`rl.rollout.play`: the
product's agent on an in-process environment server, bwrap sandbox), with a stand-in model
that renders each request as the llama.cpp engine does (code-small's chat template and
tokenizer, the tools in the template) and counts its tokens, for each of the product's
toolsets.

    python bench/rl/prompt_tokens.py examples/rl/smoke.toml
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from typing import Any

import llama_cpp

from codeplane.config import load_settings
from codeplane.core.chat import Sampling, Turn
from codeplane.models.engine import compile_chat_template, render_chat_template
from codeplane.models.pull import ensure_weights
from codeplane.models.registry import ModelRegistry
from codeplane.rl.config import load_config
from codeplane.rl.envserver import EnvServer
from codeplane.rl.rollout import play
from codeplane.rl.run import split_tasks


class TokenCounter:
    """A ChatModel that answers at once and counts each request's prompt tokens."""

    name = "token-counter"

    def __init__(self, gguf: Path) -> None:
        self.llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
        self.source = str(self.llm.metadata["tokenizer.chat_template"])
        self.template = compile_chat_template(self.source)
        self.sizes: list[int] = []

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def close(self) -> None:
        """Nothing to release."""

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        shown = tools if sampling.tool_choice != "none" else []  # as the samplers render
        text = render_chat_template(self.template, self.source, messages, shown,
                                    bos_token="", eos_token="<|im_end|>")
        self.sizes.append(len(self.llm.tokenize(text.encode(), add_bos=False, special=True)))
        return Turn({"role": "assistant", "content": "done"}, "stop", {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a run's TOML (examples/rl/*.toml)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    task = split_tasks(cfg, "train")[0]
    settings = load_settings()
    gguf = ensure_weights(ModelRegistry(settings).get(cfg.sampler.model), settings)
    out = {"config": str(args.config), "task": task.id}
    for toolset in ("core", "full"):
        model = TokenCounter(gguf)
        env = EnvServer(cfg.env)
        try:
            play(model, env, task, "g", cfg.rollout.model_copy(update={"toolset": toolset}))
        finally:
            env.close()
        out[f"first_prompt_tokens_{toolset}"] = model.sizes[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
