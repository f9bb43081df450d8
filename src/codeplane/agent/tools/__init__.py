"""The agent's tools, one module per kind, and the one table of them.

`TOOLS` is the standard toolset's registry: name -> `Tool`, in the order the model is offered
their schemas (the order is part of the prompt, and so of its KV-cache prefix). Adding a tool:
write it in the module of its kind (or a new one) with `@tool(...)` from `agent/toolset.py`,
then add one row here.
"""

from __future__ import annotations

from codeplane.agent.tools.edit import create_file, delete_file, edit_file
from codeplane.agent.tools.files import file_search, list_dir, read_file
from codeplane.agent.tools.lint import read_lints
from codeplane.agent.tools.plan import todo_write
from codeplane.agent.tools.search import codebase_search, grep
from codeplane.agent.tools.shell import run_terminal_cmd
from codeplane.agent.toolset import Tool, Toolset

TOOLS: dict[str, Tool] = {
    "read_file": read_file,
    "list_dir": list_dir,
    "file_search": file_search,
    "grep": grep,
    "codebase_search": codebase_search,
    "edit_file": edit_file,
    "create_file": create_file,
    "delete_file": delete_file,
    "read_lints": read_lints,
    "run_terminal_cmd": run_terminal_cmd,
    "todo_write": todo_write,
}
# The "core" set for small local models: fewer tools and arguments to choose from. It offers
# codebase_search: localisation by meaning is what the search tool does better than grep, and
# an RL policy trains on a toolset the product offers (the cost in prompt tokens: docs/rl.md).
CORE = ["read_file", "list_dir", "grep", "codebase_search", "edit_file", "create_file",
        "delete_file", "run_terminal_cmd"]


def default_toolset() -> Toolset:
    """The standard tools, in the order their schemas are offered to the model."""
    return Toolset(TOOLS.values())
