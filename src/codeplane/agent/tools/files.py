"""Reading the workspace: read_file, list_dir, file_search."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.tools.common import (
    MAX_READ_LINES,
    PATH,
    kind_of,
    list_files,
    missing,
    read_text,
    split_lines,
)
from codeplane.agent.toolset import ToolContext, tool


@tool("read_file", "Read a text file. Reads up to 400 lines at a time; pass start_line/end_line "
      "(1-based, inclusive) for other parts. Read several files at once by calling this tool "
      "several times in one turn.",
      {"path": PATH, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
      ("path",), "read", "call read_file with start_line/end_line for the rest", inline=True)
def read_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"])
    kind = kind_of(env, path)
    if kind == "dir":
        raise ToolError(f"{args['path']} is a directory; use list_dir")
    if kind is None:
        raise missing(env, args["path"])
    fmt = read_text(env, path)
    lines = split_lines(fmt.shown)
    ctx.seen.add(path)
    first = max(args.get("start_line") or 1, 1)
    last = min(args.get("end_line") or first + MAX_READ_LINES - 1, len(lines),
               first + MAX_READ_LINES - 1)
    rel = env.relative(path)
    if not lines:
        return f"{rel} is empty", {"lines": 0}
    if first > len(lines):
        raise ToolError(f"start_line {first} is past the end ({len(lines)} lines)")
    body = "\n".join(lines[first - 1:last])
    note = (f"\n[lines {last + 1}-{len(lines)} not shown; call read_file with "
            f"start_line={last + 1}]" if last < len(lines) else "")
    kind = "" if fmt.label == "UTF-8" else f"; {fmt.label}"
    return (f"{rel} (lines {first}-{last} of {len(lines)}{kind}):\n{body}{note}",
            {"lines": len(lines), "encoding": fmt.label})


@tool("list_dir", "List a directory: sub-directories end with '/', files show their size.",
      {"path": {**PATH, "description": "Directory relative to the workspace root (default .)"}},
      (), "read", "list a sub-directory", inline=True)
def list_dir(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args.get("path") or ".")
    if kind_of(env, path) != "dir":
        raise ToolError(f"{args.get('path')} is not a directory")
    rows = []
    for entry in sorted(env.workspace.list(path), key=lambda e: (e.stat.kind != "dir", e.name)):
        if entry.stat.kind == "symlink":
            rows.append(f"{entry.name} -> {entry.stat.target}")
        elif entry.stat.kind == "dir":
            rows.append(f"{entry.name}/")
        else:
            rows.append(f"{entry.name} ({entry.stat.size} bytes)")
    return f"{env.relative(path)}:\n" + ("\n".join(rows) or "(empty)"), {"entries": len(rows)}


@tool("file_search", "Find files by name: a glob (e.g. '**/test_*.py') or a fuzzy part of "
      "the name (e.g. 'usrsrv' finds user_service.py).",
      {"query": {"type": "string"}, "path": {**PATH, "description": "Directory to search in"}},
      ("query",), "read", "use a more specific query")
def file_search(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    query = args["query"].strip()
    if not query:
        raise ToolError("query is empty")
    files = list(list_files(env, env.resolve(args.get("path") or ".")))
    if any(c in query for c in "*?["):
        hits = [f for f in files if fnmatch.fnmatch(f, query)
                or fnmatch.fnmatch(Path(f).name, query) or fnmatch.fnmatch(f, f"**/{query}")]
    else:
        scored = [(s, f) for f in files if (s := _fuzzy(query.lower(), f.lower())) is not None]
        hits = [f for _, f in sorted(scored)]
    if not hits:
        return f"no files match {query!r}", {"count": 0}
    shown = hits[:50]
    more = f"\n[{len(hits) - 50} more]" if len(hits) > 50 else ""
    return "\n".join(shown) + more, {"count": len(hits)}


def _fuzzy(query: str, path: str) -> tuple[int, int] | None:
    """Rank: name contains query < path contains query < query is a subsequence."""
    name = path.rsplit("/", 1)[-1]
    if query in name:
        return (0, len(path))
    if query in path:
        return (1, len(path))
    pos = 0
    for ch in query:
        pos = path.find(ch, pos) + 1
        if pos == 0:
            return None
    return (2, len(path))
