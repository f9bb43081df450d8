"""A warm start: a few supervised steps on a scripted solver's successful episodes (train split
only) before reinforcement learning.

Why: code-small's base success on the locate family is 0 (it invents tool names, or calls
tools until the turn limit), so every group's rewards are equal, the DAPO filter drops every
group and GRPO gets no gradient. Imitating a handful of solved train episodes teaches the
protocol (one grep call in the product's `<tool_call>` format, then `path:line`); RL then has
reward variance to work with. It is part of the training pipeline and budget, and the run
records held-out success before it (the base model) and after it.

A solver is a scripted `ChatModel` that solves a family's task the way a policy should; its
turns carry the token ids the policy would have had to sample (the chat template rendered by
the policy's tokenizer, the end-of-turn token included), so the episodes it produces through
the real environment servers are training samples. `SOLVERS` says which family each solves:

- `GrepSolver` (locate, "grep" instruction): grep with the pattern the instruction names,
  then the first `.py` hit's `path:line`.
- `SearchSolver` (commits): what issue 31 asks the product's agent to learn - one
  `codebase_search` for the change request (whole files ranked), the top hits read in ONE
  turn of parallel `read_file` calls around their best lines, then the top file named. It
  does not know the answer: only its solved episodes are imitated, so the policy learns the
  protocol (search, parallel reads, a short answer) from the episodes where it works.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Protocol

from codeplane.core.chat import Sampling, Turn
from codeplane.models.toolcalls import assistant_turn
from codeplane.rl.commits import INSTRUCTION
from codeplane.rl.types import Episode, Sample

_CALL = re.compile(r"Call grep with (\{.*?\})")
_HIT = re.compile(r"^([\w./-]+\.py):(\d+):", re.MULTILINE)
# codebase_search's output: one "path:start-end (score s)" header per hit
_SEARCH_HIT = re.compile(r"^(\S+):(\d+)-(\d+) \(score ", re.MULTILINE)
_QUESTION = INSTRUCTION.split("{request}", 1)[1]  # what follows the request in the task
# The search solver's turns stay short (each token of a turn's prompt is trainer time): five
# files ranked, the top two read in one parallel turn, 30 lines from each one's best chunk.
HITS, READS, READ_LINES = 5, 2, 30


class Tokenizing(Protocol):
    """What the solver needs of the policy: its prompt rendering and tokenizer."""

    tokenizer: Any

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None
                   ) -> list[int]: ...


class Solver:
    """A scripted `ChatModel` whose turns are training samples; a subclass writes `_reply`."""

    name = "solver"

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
        raise NotImplementedError


class GrepSolver(Solver):
    """The "grep" instruction's solver (see the module docstring)."""

    name = "grep-solver"

    @staticmethod
    def _reply(messages: list[dict]) -> str:
        """The grep call the instruction names, or the first `.py` hit of its output."""
        results = _results(messages)
        if not results:
            named = _CALL.search(messages[-1].get("content") or "")
            return _calls([("grep", json.loads(named.group(1)) if named else {})])
        hit = _HIT.search(results[-1])
        return f"{hit.group(1)}:{hit.group(2)}" if hit else "not found"


class SearchSolver(Solver):
    """The commits family's solver: search, read the top hits in parallel, name the top file
    (see the module docstring)."""

    name = "search-solver"

    @staticmethod
    def _reply(messages: list[dict]) -> str:
        results = _results(messages)
        if not results:
            task = next(m.get("content") or "" for m in messages if m.get("role") == "user")
            request = task.split(_QUESTION, 1)[0].strip()
            return _calls([("codebase_search", {"query": request, "files": True,
                                                "limit": HITS})])
        best: dict[str, int] = {}  # each file's best hit's first line, best file first
        for path, start, _ in _SEARCH_HIT.findall(results[0]):
            best.setdefault(path, int(start))
        top = list(best.items())[:READS]
        if not top:
            return "No file matches this change."
        if len(results) == 1:
            return _calls([("read_file", {"path": path, "start_line": start,
                                          "end_line": start + READ_LINES - 1})
                           for path, start in top])
        return f"The change touches {top[0][0]}."


def _results(messages: list[dict]) -> list[str]:
    return [m.get("content") or "" for m in messages if m.get("role") == "tool"]


def _calls(calls: list[tuple[str, dict]]) -> str:
    """Tool calls in the product's format, several in one reply (they run in parallel)."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": name, "arguments": args})
                     + "\n</tool_call>" for name, args in calls)


# Which solver a warm start runs, by task family (and, for locate, its instruction).
SOLVERS: dict[tuple[str, str | None], type[Solver]] = {
    ("locate", "grep"): GrepSolver,
    ("commits", None): SearchSolver,
}


def solver_for(family: str, instruction: str | None) -> type[Solver] | None:
    return SOLVERS.get((family, instruction if family == "locate" else None))


def demonstrations(episodes: list[Episode], min_reward: float = 1.0) -> list[list[Sample]]:
    """What is imitated: the turns of each episode that scored at least `min_reward` without
    a fault, one list per episode. Kept whole, in order, so the trainer scores an episode's
    turns in one forward pass (rl/trainer.py `rows_of`)."""
    return [e.samples for e in episodes if e.reward >= min_reward and e.fault is None]
