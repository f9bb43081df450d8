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
  `codebase_search` for the change request (whole files ranked), the top source files among
  its hits (tests, documentation and configuration dropped) read in ONE turn of parallel
  `read_file` calls around their best lines, then the file whose path and read lines hold
  most of the request's words named, its search rank breaking ties. It uses only what the product's agent is shown (the request, the tools' output
  as cut for the model) and does not know the answer: only its good episodes are imitated,
  so the policy learns the protocol (search, parallel reads, a short answer) from the
  episodes where it works.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import threading
from collections import Counter
from typing import Any, Protocol

from codeplane.core.chat import Sampling, Turn
from codeplane.models.toolcalls import assistant_turn
from codeplane.rl import changes
from codeplane.rl.commits import INSTRUCTION
from codeplane.rl.types import Episode, Sample

_CALL = re.compile(r"Call grep with (\{.*?\})")
_HIT = re.compile(r"^([\w./-]+\.py):(\d+):", re.MULTILINE)
# codebase_search's output: one "path:start-end (score s)" header per hit
_SEARCH_HIT = re.compile(r"^(\S+):(\d+)-(\d+) \(score ", re.MULTILINE)
_QUESTION = INSTRUCTION.split("{request}", 1)[1]  # what follows the request in the task
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")  # camelCase and snake_case parts
# Words that say nothing about where a change goes (English filler and change-log verbs).
_FILLER_WORDS = """a an the and or of to in on for with from by at as is are was were be
been it its this that these those not no when if than then so but into out up use used
using via all any can could should would will do does did has have had fix fixed fixes add
added adds allow allowed make made now new support supported ensure instead also only
more less some such which what who how why where there their they them"""
_FILLER = frozenset(_FILLER_WORDS.split())
# The search solver's turns stay short (each token of a turn's prompt is trainer time): five
# files ranked per search, the top READS source files read in one parallel turn, READ_LINES
# lines from each one's best chunk. Tuned on the train tasks of examples/rl/product.toml
# (docs/rl.md, "Solver").
HITS, READS, READ_LINES = 5, 3, 30
RRF_K = 2  # reciprocal-rank constant: the top file scores 1/2, the second 1/3, ...
OVERLAP = 2.0  # weight of the read lines' share of the request's words against the rank


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
    """The commits family's solver (see the module docstring): search, the source files
    among the hits read in one parallel turn, the one whose lines say most of the request
    named."""

    name = "search-solver"

    @staticmethod
    def _reply(messages: list[dict]) -> str:
        request = _request(messages)
        searches, reads = _results(messages, "codebase_search"), _results(messages, "read_file")
        if not searches:
            return _calls([("codebase_search", {"query": request, "files": True,
                                                "limit": HITS})])
        ranked = candidates(searches[0])
        if not ranked:
            return "No file matches this change."
        if not reads:
            return _calls([("read_file", {"path": path, "start_line": start,
                                          "end_line": start + READ_LINES - 1})
                           for path, start in ranked[:READS]])
        return f"The change touches {choose(request, [p for p, _ in ranked[:READS]], reads)}."


def candidates(search: str) -> list[tuple[str, int]]:
    """The source files of a file ranking as the tool showed it (its output is cut, so only
    its first hits count), in its order, each with the first line of its best hit. Tests,
    documentation and configuration are never a change request's answer here
    (rl/changes.py)."""
    shown: dict[str, int] = {}
    for path, line, _ in _SEARCH_HIT.findall(search):
        if changes.SOURCE.search(path) and not changes.is_test(path):
            shown.setdefault(path, int(line))
    return list(shown.items())


def choose(request: str, ranked: list[str], reads: list[str]) -> str:
    """The file to name among the `ranked` candidates that were read: each scores its search
    rank plus the share of the request's words its path and read lines hold (two
    neighbouring words joined count as a bonus), a term counting less the more candidates
    hold it (a word every file has says nothing). One file, never two: naming a second
    costs a third of the reward when the first is right (F1 2/3), and on the train tasks
    it lost more successes than it won (docs/rl.md, "Solver")."""
    wanted, words = terms(request, pairs=True), len(terms(request)) or 1
    seen = {path: terms(path) for path in ranked}
    for output in reads:
        path = output.split(" (lines ", 1)[0]
        if path in seen:
            seen[path] |= terms(output)
    holders = Counter(t for held in seen.values() for t in held & wanted)
    score = {path: 1 / (RRF_K + rank)
             + OVERLAP * sum(1 / holders[t] for t in sorted(held & wanted)) / words
             for rank, (path, held) in enumerate(seen.items())}
    return max(score, key=lambda p: score[p])  # the first of equals: the better ranked


def terms(text: str, pairs: bool = False) -> set[str]:
    """Lower-case words of identifiers and prose (snake_case and camelCase split, the whole
    identifier kept), filler and short words dropped, a plural "s" cut; with `pairs`, two
    neighbours joined too ("import hook" also gives "importhook", as a module is named)."""
    words = []
    for token in _WORD.findall(text):
        parts = [p.lower() for p in _PART.findall(token)]
        words += [*parts, token.lower().replace("_", "")] if len(parts) > 1 else parts
    kept = [_stem(w) for w in words if len(w) > 2 and w not in _FILLER]
    joined = [_stem(a + b) for a, b in itertools.pairwise(kept)] if pairs else []
    return set(kept) | set(joined)


def _stem(word: str) -> str:
    """A plural's singular, roughly ("retries" -> "retry", "hooks" -> "hook")."""
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    return word[:-1] if word.endswith("s") and not word.endswith("ss") and len(word) > 4 \
        else word


def _request(messages: list[dict]) -> str:
    task = next(m.get("content") or "" for m in messages if m.get("role") == "user")
    return task.split(_QUESTION, 1)[0].strip()


def _results(messages: list[dict], tool: str | None = None) -> list[str]:
    """The tool outputs the model was shown, in order (of one tool's calls, if named)."""
    return [m.get("content") or "" for m in messages
            if m.get("role") == "tool" and tool in (None, m.get("name"))]


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


def batches(demos: list[list[Sample]], steps: int, size: int, seed: int
            ) -> list[list[list[Sample]]]:
    """The warm start's `steps` batches of `size` episodes: seeded shuffles of the
    demonstrations, taken in turn, so every one is imitated before any is imitated twice
    (with `steps` x `size` >= their number, each at least once; a batch drawn at random
    each step could repeat one and never reach another)."""
    size = min(size, len(demos))
    order = random.Random(seed)
    queue: list[list[Sample]] = []
    out = []
    for _ in range(steps):
        while len(queue) < size:
            epoch = list(demos)
            order.shuffle(epoch)
            queue += epoch
        out.append(queue[:size])
        del queue[:size]
    return out
