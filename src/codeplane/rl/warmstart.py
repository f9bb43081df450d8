"""A warm start: a few supervised steps on a scripted solver's successful episodes (train split
only) before reinforcement learning.

Why: code-small's base success on the locate family is 0 (it invents tool names, or calls
tools until the turn limit), so every group's rewards are equal, the DAPO filter drops every
group and GRPO gets no gradient. Imitating a handful of solved train episodes teaches the
protocol (one grep call in the product's `<tool_call>` format, then `path:line`); RL then has
reward variance to work with. It is part of the training pipeline and budget, and the run
records held-out success before it (the base model) and after it.

`GrepSolver` is a `ChatModel` that solves a "grep"-instruction locate task the way a policy
should: it calls grep with the pattern the instruction names, then answers with the first
`.py` hit's `path:line`. Its turns carry the token ids the policy would have had to sample
(the chat template rendered by the policy's tokenizer, the end-of-turn token included), so
the episodes it produces through the real environment servers are training samples.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Protocol

from codeplane.core.chat import Sampling, Turn
from codeplane.rl.policy import assistant_turn
from codeplane.rl.types import Episode, Sample

_CALL = re.compile(r"Call grep with (\{.*?\})")
_HIT = re.compile(r"^([\w./-]+\.py):(\d+):", re.MULTILINE)


class Tokenizing(Protocol):
    """What the solver needs of the policy: its prompt rendering and tokenizer."""

    tokenizer: Any

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None
                   ) -> list[int]: ...


class GrepSolver:
    """A scripted `ChatModel` for the "grep" instruction (see the module docstring)."""

    name = "grep-solver"

    def __init__(self, policy: Tokenizing) -> None:
        self.policy = policy
        self.version = 0
        self._end = policy.tokenizer.eos_token_id  # <|im_end|> for the Qwen chat models

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def close(self) -> None:
        """Nothing to release."""

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        shown = tools if sampling.tool_choice != "none" else []  # as LlamaSampler renders
        text = self._reply(messages)
        message, finish = assistant_turn(text, shown, "stop")
        prompt = self.policy.prompt_ids(messages, shown)
        ids = [*self.policy.tokenizer(text, add_special_tokens=False)["input_ids"], self._end]
        return Turn(message, finish, {}, [0.0] * len(ids), prompt, ids, self.version)

    @staticmethod
    def _reply(messages: list[dict]) -> str:
        """The grep call the instruction names, or the first `.py` hit of its output."""
        results = [m.get("content") or "" for m in messages if m.get("role") == "tool"]
        if not results:
            named = _CALL.search(messages[-1].get("content") or "")
            args = json.loads(named.group(1)) if named else {}
            return ("<tool_call>\n" + json.dumps({"name": "grep", "arguments": args})
                    + "\n</tool_call>")
        hit = _HIT.search(results[-1])
        return f"{hit.group(1)}:{hit.group(2)}" if hit else "not found"


def demonstrations(episodes: list[Episode]) -> list[Sample]:
    """The turns of the solved episodes (reward 1, no fault): what is imitated."""
    return [s for e in episodes if e.reward == 1.0 and e.fault is None for s in e.samples]
