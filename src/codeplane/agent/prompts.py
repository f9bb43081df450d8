"""The system prompt and the harness's hints. Short on purpose: small local models (0.5B-1.5B)
follow a few concrete rules better than a long policy.

The system prompt is the same for every run and workspace: the chat template puts the tool
schemas right after it, so together they form a long prefix the server's KV cache keeps from
run to run (prefilling it is most of a cold turn on CPU: docs/agent.md, "The loop").
Everything that varies - the task and the file listing - comes after it, in the user message.
The one variant is whether the "Look" step names codebase_search: only when the toolset
offers it (the prompt must not name a tool the model cannot call), so the prompt is fixed per
toolset, not per run.
An offered tool on a workspace that is not indexed keeps the mention (whether an index exists
is a per-run fact; the tool's answer then says to use grep), so one configuration keeps one
cached prefix."""

from __future__ import annotations

from collections.abc import Iterable

_SYSTEM = """You are a coding agent. You work in a repository (the current directory) and \
complete the user's task by calling tools. You cannot see any file until you read it.

Work in four steps:
1. Look: read the files the task is about with read_file;{search} find others with grep \
or list_dir. When you need several independent things, call all of those tools in the same \
turn; they run in parallel.
2. Change: edit_file replaces old_string with new_string. A file must be read before you \
edit it; copy old_string exactly from the read_file output, including indentation. Use \
create_file for new files and delete_file to remove one.
3. Check: run the tests or the program with run_terminal_cmd (for Python tests: python -m \
pytest -q). If something fails, read the output and fix it. Fix the code, not the tests, \
unless the task asks you to change tests.
4. Answer: when the task is done, reply with one or two sentences saying what you changed, \
and call no tool.

Paths are relative to the repository root, written exactly as in the file list the user \
gives you."""
# With a Look step naming only read_file, grep and list_dir, code-medium never called
# codebase_search on the click tasks and guessed the file instead; told about the tool it
# searched, and the top hit was mostly the fix file (docs/search.md, "The agent's view").
SEARCH_STEP = (" if the task does not say which file to change, find where it is implemented "
               "with codebase_search, then read_file the hit;")
SYSTEM = _SYSTEM.format(search="")  # the prompt for a toolset without codebase_search
MAX_FILES = 40

NUDGE = ("You have not used any tool yet, so nothing has changed. Call the tools needed to "
         "do the task now. If it truly needs no change, repeat your final answer.")
FAKE_RESULT = ("Do not write <tool_call> or <tool_response> text yourself: call a tool and "
               "the harness returns its result. Call the next tool now, or answer in plain "
               "sentences if the task is done.")
EMPTY = ("Your reply was empty. If the task is done, say in one or two sentences what you "
         "changed; otherwise call the next tool.")
NOTHING_CHANGED = ("No file has changed in this run: {why}. If the task needs a change, "
                   "make it now with edit_file (old_string copied exactly from read_file "
                   "output) or create_file.")
BROKEN = ("Your change left syntax errors:\n{errors}\nRead the file again and fix them with "
          "edit_file.")
VERIFY = ("Before you finish, check your change: run the tests with run_terminal_cmd "
          "(python -m pytest -q) and fix what fails.")
CODE_NOT_APPLIED = ("You showed code, but no file has changed: the user cannot apply it. Make "
                    "the change with edit_file (old_string copied from read_file output) or "
                    "create_file now.")


def system_prompt(tools: Iterable[str]) -> str:
    """The system prompt for an agent offered the tools named `tools`: the Look step names
    codebase_search only when it is one of them."""
    return _SYSTEM.format(search=SEARCH_STEP if "codebase_search" in tools else "")


def task_message(task: str, files: list[str]) -> str:
    """The task plus the first files of the repository: small models otherwise guess names
    (or copy an absolute root path wrongly) before they think of listing the directory."""
    more = f" (first {MAX_FILES} of {len(files)})" if len(files) > MAX_FILES else ""
    listing = "\n".join(files[:MAX_FILES]) or "(none)"
    return f"{task}\n\nFiles in the repository{more}:\n{listing}"
