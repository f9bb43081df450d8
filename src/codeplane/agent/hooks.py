"""The small-model repairs around the agent loop, as switchable hooks.

The loop (`loop.py`) is Model -> tool calls -> Environment until an answer. Everything here
exists because 0.5B-1.5B models miss that protocol in predictable ways: they invent tool names,
paste code instead of editing, stop before doing anything, or claim changes they never made.
The product runs every hook (`PRODUCT_HOOKS`); an RL run may run none, so the policy is
rewarded for what it did itself, and its transcript says which hooks were on.

A hook is made fresh for each run (it may keep per-run state) and sees the running `Agent`
through its public attributes: `env`, `toolset`, `tools`, `ctx`, `config`, `calls_made`,
`failed_writes`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any

import pathspec

from codeplane.agent.prompts import (
    BROKEN,
    CODE_NOT_APPLIED,
    EMPTY,
    NOTHING_CHANGED,
    NUDGE,
    VERIFY,
)
from codeplane.agent.tools.common import mentioned, shown_text, syntax_errors
from codeplane.models.toolcalls import parse_tool_calls

if TYPE_CHECKING:
    from codeplane.agent.loop import Agent


class Hook:
    """No-op defaults: a hook overrides the points it cares about."""

    name = "hook"

    def start(self, agent: Agent, task: str, files: list[str]) -> str:
        """Text appended to the task message, given the workspace's files."""
        return ""

    def repair(self, agent: Agent, content: str) -> list[dict]:
        """Tool calls recovered from a reply that made none ([]: nothing to recover)."""
        return []

    def correct(self, agent: Agent, content: str) -> tuple[str | None, bool]:
        """A hint instead of ending the run on a reply without tool calls, and whether the
        next turn must call a tool ((None, False): the reply stands as the answer)."""
        return None, False


def tool_names(agent: Agent) -> set[str]:
    return {t["function"]["name"] for t in agent.tools}


def invented_tools_note(content: str, names: set[str]) -> str | None:
    """The hint for a reply whose calls (written as text) name tools that do not exist,
    listing the ones that do; None when it names none."""
    bogus = {c.name for c in parse_tool_calls(content, AnyName(names))[1]} - names
    if not bogus:
        return None
    return (f"error: {', '.join(sorted(bogus))} is not a tool. Available tools: "
            f"{', '.join(sorted(names))}. Call one of them.")


def arguments(raw: Any) -> dict | str:
    """A call's arguments as a dict, or the raw text when they are not a JSON object."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return str(raw)
    return value if isinstance(value, dict) else str(raw)


class Preread(Hook):
    """Files the task names, read for the model and appended to the task: like an
    @-mention in an editor. Small models otherwise edit files they never read. Plain
    text rather than a made-up read_file turn: after such a turn small models copy
    `<tool_response>` blocks instead of acting (docs/agent.md counts the runs).

    Secret files (`.env`, keys, credentials) are never pre-read: the prompt leaves this
    machine when the model is a provider, and a task naming `id_rsa` is no consent."""

    name = "preread"

    def start(self, agent: Agent, task: str, files: list[str]) -> str:
        named = [f for f in mentioned(task, files) if not _SECRET_FILES.match_file(f)]
        parts = [agent.toolset.execute(agent.env, "read_file", {"path": path}, agent.ctx,
                                       agent.config.max_result_chars).output
                 for path in named[: agent.config.preread]]
        parts = [p for p in parts if _PRIVATE_KEY not in p]
        if not parts:
            return ""
        return ("\n\nThe files the task names, already read for you (you may edit them):\n\n"
                + "\n\n".join(parts))


class CallRepair(Hook):
    """Calls to invented tool names whose arguments fit exactly one real tool, as calls
    of that tool. code-small mostly names the tool after the task
    (`{"name": "change_server_port", "arguments": {"path": ..., "start_line": 1}}`) and
    repeats itself word for word after a hint; the history then shows the right name."""

    name = "call_repair"

    def repair(self, agent: Agent, content: str) -> list[dict]:
        params = {t["function"]["name"]: t["function"]["parameters"] for t in agent.tools}
        repaired = []
        for call in parse_tool_calls(content, AnyName(params))[1]:
            args = arguments(call.arguments)
            fits = [name for name, p in params.items() if isinstance(args, dict) and args
                    and set(p["required"]) <= set(args) <= set(p["properties"])]
            if call.name in params or len(fits) != 1:
                return []
            repaired.append({"id": call.id, "type": "function",
                             "function": {"name": fits[0], "arguments": call.arguments}})
        return repaired


class CodeBlockEdit(Hook):
    """A reply that shows new code instead of editing - what 1.5B models do most - as
    `edit_file(code_edit=<the code>)` on the file it belongs to, merged by the apply
    compartment (like an editor's Apply button on a chat code block). Only before any
    file changed, with one code block, for the one file this run has read that defines
    one of the block's functions or classes (Python, JavaScript, TypeScript)."""

    name = "code_block_edit"

    def repair(self, agent: Agent, content: str) -> list[dict]:
        blocks = _FENCE.findall(content)
        if agent.ctx.written or len(blocks) != 1 or "edit_file" not in tool_names(agent):
            return []
        names = set(_DEFINES.findall(blocks[0]))
        owners = sorted(agent.env.relative(p) for p in agent.ctx.seen
                        if names & set(_DEFINES.findall(shown_text(agent.env, p) or "")))
        if len(owners) != 1:
            return []
        args = json.dumps({"path": owners[0], "code_edit": blocks[0]})
        return [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": "edit_file", "arguments": args}}]


class Corrections(Hook):
    """A hint instead of ending the run, when a reply is not really a final answer.

    Before the answer: it names a tool that does not exist (small models invent them),
    shows code instead of editing, or nothing was done at all. (A reply that is nothing but
    markup - a call written as text, a made-up tool result - gets its hint from the loop
    itself, hooks or not.) At the answer, what a reviewer would check first: the task asks
    for a change (or the answer claims one) but no file changed (small models say "I changed
    ..." after failed edits, or restate the task: docs/agent.md), the changed files no
    longer parse, or tests exist and were never run after the last change."""

    name = "corrections"

    def __init__(self) -> None:
        self.has_tests = self.verified = self.change_task = False

    def start(self, agent: Agent, task: str, files: list[str]) -> str:
        self.has_tests = any(_TEST_FILE.search(f) for f in files)
        self.change_task = bool(_CHANGE.search(task)) and not _asks_a_question(task)
        return ""

    def correct(self, agent: Agent, content: str) -> tuple[str | None, bool]:
        invented = invented_tools_note(content, tool_names(agent))
        if invented:
            return invented, False
        if "```" in content and not agent.ctx.written:
            return CODE_NOT_APPLIED, True
        if agent.calls_made == 0:
            return NUDGE, False
        if not agent.ctx.written and (self.change_task or _CLAIM.search(content)):
            why = ("every edit you tried failed" if agent.failed_writes
                   else "you have not edited any file")
            return NOTHING_CHANGED.format(why=why), True
        errors = [e for p in sorted(agent.ctx.written)
                  if (source := shown_text(agent.env, p)) is not None
                  for e in syntax_errors(p, source, agent.env.relative(p))]
        if errors:
            return BROKEN.format(errors="\n".join(errors[:5])), True
        if self._needs_check(agent):
            self.verified = True
            return VERIFY, True
        return (EMPTY if not content.strip() else None), False

    def _needs_check(self, agent: Agent) -> bool:
        """Python changed, the repository has tests, and no command ran since: asked once."""
        return (self.has_tests and not self.verified and not agent.ctx.checked
                and any(p.suffix == ".py" for p in agent.ctx.written)
                and "run_terminal_cmd" in tool_names(agent))


# name -> hook class, in the order the loop consults them (repairs: call_repair first).
HOOKS: dict[str, type[Hook]] = {h.name: h for h in (Preread, CallRepair, CodeBlockEdit,
                                                     Corrections)}
PRODUCT_HOOKS: tuple[str, ...] = tuple(HOOKS)


def _asks_a_question(task: str) -> bool:
    """The task's last paragraph is a question ("Which files would this change touch?"):
    it may describe a change, but what it asks for is an answer, not an edit."""
    paragraphs = [p for p in task.strip().split("\n\n") if p.strip()]
    return bool(paragraphs) and bool(_QUESTION.match(paragraphs[-1]))


class UnknownHook(ValueError):
    """No hook of that name; the message lists the ones there are."""


def make_hooks(names: tuple[str, ...] | list[str]) -> list[Hook]:
    """Fresh hooks for one run, in the table's order whatever order `names` has."""
    unknown = sorted(set(names) - set(HOOKS))
    if unknown:
        raise UnknownHook(f"unknown agent hook(s) {', '.join(unknown)}; available: "
                          f"{', '.join(HOOKS)}")
    return [cls() for name, cls in HOOKS.items() if name in names]


class AnyName(set):
    """Lets the lenient tool-call parser find calls to names that are not tools."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(name)


# Never pre-read into a prompt. Narrower than the index's ignore list (indexing/scan.py),
# which also skips build and vendor folders that a task may rightly name.
_SECRET_FILES = pathspec.GitIgnoreSpec.from_lines([
    ".env", ".env.*", "*.env", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks",
    "*.keystore", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".ssh/", ".aws/",
    ".gnupg/", ".netrc", ".npmrc", ".pypirc", ".git-credentials", "credentials*.json",
    "secret*.json", "secret*.y*ml", "secret*.toml", "*.secret", ".htpasswd"])
_PRIVATE_KEY = "PRIVATE KEY-----"  # a PEM key under any name
_TEST_FILE = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$)")
# A task that asks for a change ("Fix ...", "rename ...", "should also include ...").
_CHANGE = re.compile(r"\b(?:fix|implement|rename|add|change|create|delete|remove|update|"
                     r"replace|refactor|move|edit|include|make)\b", re.IGNORECASE)
# A question: an interrogative word, then a question mark in the same sentence.
_QUESTION = re.compile(r"\s*(?:which|what|where|who|whose|why|how|when|is|are|does|do|did|"
                       r"can|could|would|should|will)\b[^.!?]*\?", re.IGNORECASE)
# A final answer that reports a change: "I changed ...", "... and fixed it", "has been added".
_CLAIM = re.compile(r"\b(?:changed|updated|fixed|modified|renamed|added|removed|replaced|"
                    r"implemented|created|deleted|edited|corrected)\b", re.IGNORECASE)
_FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)```", re.DOTALL)
# Definitions that tie a code block to a file: Python `def`/`class`, JS/TS `function`/`class`.
_DEFINES = re.compile(r"^[ \t]*(?:export[ \t]+)?(?:async[ \t]+)?(?:def|class|function)"
                      r"[ \t]+(\w+)", re.MULTILINE)
