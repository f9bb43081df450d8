"""Searching the workspace: grep (ripgrep in the sandbox) and codebase_search (the index,
through the search service the caller injected)."""

from __future__ import annotations

import base64
import fnmatch
import json
import re
import shutil
from pathlib import Path

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.tools.common import (
    PATH,
    is_file,
    list_files,
    next_step,
    read_text,
    split_lines,
    strip_dot,
    unread_file,
)
from codeplane.agent.toolset import SearchUnavailable, ToolContext, tool

MAX_HITS = 100


@tool("grep", "Search file contents with a regular expression (ripgrep syntax). Returns "
      "path:line:text lines. Use `include` to filter files by glob, e.g. '*.py'.",
      {"pattern": {"type": "string"}, "path": {**PATH, "description": "File or directory"},
       "include": {"type": "string", "description": "glob of files to search"},
       "case_sensitive": {"type": "boolean"}},
      ("pattern",), "read", "narrow the pattern, path or include glob")
def grep(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    base = env.resolve(args.get("path") or ".")
    pattern, include = args["pattern"], args.get("include")
    sensitive = args.get("case_sensitive", True)
    rg = shutil.which("rg")
    engine = "rg" if rg else "python"

    def search(literal: bool) -> list[str]:
        return (_rg(env, rg, pattern, base, include, sensitive, literal) if rg
                else _pygrep(env, pattern, base, include, sensitive, literal))

    special = bool(_REGEX_SYNTAX.search(pattern))
    try:
        hits, note = search(literal=False), ""
    except ToolError:
        if not special:
            raise
        hits, note = [], "invalid regular expression"
    if not hits and special:
        # Models often paste code (`add(2, 3)`) as the pattern; as a regex its parentheses
        # are a group and it matches nothing. Searching it literally is what they meant.
        hits = search(literal=True)
        note = f"{note or 'no regex matches'}; matched as a literal string" if hits else note
    if not hits:
        tip = f"; {pattern} is a file: read it with read_file" if is_file(env, pattern) else ""
        tip += f" ({note}; no literal match either)" if note else ""
        return f"no matches for {pattern!r}{tip}", {"count": 0, "engine": engine}
    more = f"\n[{len(hits) - MAX_HITS} more matches not shown; narrow the search]" \
        if len(hits) > MAX_HITS else ""
    head = f"[{note}]\n" if note else ""
    shown = hits[:MAX_HITS]
    shown[0] += _grep_next(env, ctx, hits[0])  # next to its hit: truncation cuts the end
    return head + "\n".join(shown) + more, {"count": len(hits), "engine": engine}


_HIT = re.compile(r"^(.+?):(\d+):")


def _grep_next(env: Environment, ctx: ToolContext, first_hit: str) -> str:
    """The next step after a grep, spelled out when the first hit's file is unread: last
    session's transcripts show code-medium calling edit_file straight from a grep hit (which
    the read-before-edit rule refuses) and running out of turns."""
    match = _HIT.match(first_hit)
    if not match or not unread_file(env, ctx, match[1]):
        return ""
    line = int(match[2])
    return f"\n{next_step(match[1], line, line)}"


_REGEX_SYNTAX = re.compile(r"[.^$*+?()\[\]{}|\\]")


def _rg(env: Environment, rg: str, pattern: str, base: Path, include: str | None,
        sensitive: bool, literal: bool) -> list[str]:
    """ripgrep inside the sandbox (over a read-only workspace); its JSON lines tell hits
    from its error messages, which share the output stream."""
    argv = [rg, "--json", "--max-count=50", "--threads=1"]
    argv += [] if sensitive else ["--ignore-case"]
    argv += ["--fixed-strings"] if literal else []
    argv += ["--glob", include] if include else []
    argv += ["--regexp", pattern, "--", env.relative(base)]
    res = env.exec(argv, stderr=True)
    hits, errors = [], []
    for line in res.output.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            errors.append(line)
            continue
        if event.get("type") == "match" and len(hits) < MAX_HITS * 5:
            data = event["data"]
            text = _rg_text(data["lines"]).rstrip("\r\n")[:300]
            hits.append(f"{strip_dot(_rg_text(data['path']))}:{data['line_number']}:{text}")
    if res.exit_code == 2 and not hits:
        raise ToolError(f"grep failed: {' '.join(errors).strip()[:500]}")
    return hits


def _rg_text(field: dict) -> str:
    """ripgrep's JSON carries non-UTF-8 paths and lines as base64 "bytes"."""
    if "text" in field:
        return field["text"]
    return base64.b64decode(field.get("bytes", "")).decode(errors="replace")


def _pygrep(env: Environment, pattern: str, base: Path, include: str | None,
            sensitive: bool, literal: bool) -> list[str]:
    """Fallback when ripgrep is absent: Python `re`, skipping binary and ignored dirs."""
    try:
        regex = re.compile(re.escape(pattern) if literal else pattern,
                           0 if sensitive else re.IGNORECASE)
    except re.error as exc:
        raise ToolError(f"invalid regular expression: {exc}") from None
    hits: list[str] = []
    for rel in list_files(env, base, use_rg=False):
        if include and not fnmatch.fnmatch(Path(rel).name, include) \
                and not fnmatch.fnmatch(rel, include):
            continue
        try:
            text = read_text(env, env.root / rel).shown  # the resolver: no symlink out, no FIFO
        except ToolError:
            continue
        hits += [f"{rel}:{n}:{line[:300]}" for n, line in enumerate(split_lines(text), 1)
                 if regex.search(line)]
        if len(hits) > MAX_HITS * 5:
            break
    return hits


@tool("codebase_search", "Semantic search: find code by meaning ('where are passwords "
      "hashed?'). Returns the most relevant snippets with paths and line ranges.",
      {"query": {"type": "string"}, "limit": {"type": "integer"},
       "target_directories": {"type": "array", "items": {"type": "string"}},
       "files": {"type": "boolean", "description": "rank whole files: use when asking where "
                 "a change should go"}},
      ("query",), "read", "ask a narrower question")
def codebase_search(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    try:
        hits = ctx.services.search.search(env, args["query"], int(args.get("limit") or 10),
                                          files=bool(args.get("files")))
    except SearchUnavailable as exc:
        return f"index unavailable: {exc}; use grep or file_search instead", {"available": False}
    dirs = [env.relative(env.resolve(d)) for d in args.get("target_directories") or []]
    if dirs:
        hits = [h for h in hits if any(d == "." or str(h["path"]).startswith(d) for d in dirs)]
    if not hits:
        return "no results", {"available": True, "count": 0}
    blocks = [f"{h['path']}:{h['start_line']}-{h['end_line']} (score {h['score']:.2f})\n"
              f"{h.get('snippet', '')}" for h in hits]
    top = hits[0]
    if unread_file(env, ctx, str(top["path"])):  # right after the top hit: ten snippets
        # often pass the result limit, and truncation cuts the end
        blocks[0] += "\n" + next_step(str(top["path"]), top["start_line"], top["end_line"])
    return "\n\n".join(blocks), {"available": True, "count": len(hits)}
