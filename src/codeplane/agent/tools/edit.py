"""Changing files: edit_file (exact replacement, or a sketch merged by the apply service the
caller injected), create_file, delete_file. Every change reports its diff and any syntax
errors it left."""

from __future__ import annotations

import difflib
from pathlib import Path

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.tools.common import (
    MARGIN,
    MAX_READ_LINES,
    PATH,
    kind_of,
    missing,
    needs_read,
    read_call,
    read_text,
    shown_text,
    syntax_errors,
    text_or_empty,
    write_text,
)
from codeplane.agent.toolset import ToolContext, tool
from codeplane.core.files import Refused, TextFile


@tool("edit_file", "Edit a file by exact string replacement: old_string must match the file "
      "exactly (including indentation) and be unique unless replace_all is true; include a "
      "few surrounding lines to make it unique. Alternatively pass code_edit: the changed "
      "code with '# ... existing code ...' marking unchanged parts.",
      {"path": PATH, "old_string": {"type": "string"}, "new_string": {"type": "string"},
       "replace_all": {"type": "boolean"}, "code_edit": {"type": "string"}},
      ("path",), "write", inline=True)
def edit_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"], write=True)
    if kind_of(env, path) is None:
        err = missing(env, args["path"])
        raise ToolError(f"{err}; use create_file for new files")
    if needs_read(ctx, path):
        raise ToolError(_unread(env, path, args.get("old_string")))
    fmt = read_text(env, path)
    before = fmt.text
    if args.get("code_edit") is not None and args.get("old_string") is None:
        after = _apply_sketch(before, fmt.incoming(args["code_edit"]), env.relative(path), ctx)
    else:
        old, new = (args.get(k) for k in ("old_string", "new_string"))
        old, new = (fmt.incoming(v) if isinstance(v, str) else v for v in (old, new))
        try:
            after = _replace(before, old, new, bool(args.get("replace_all")))
        except ToolError as exc:
            raise ToolError(f"{exc}{_found_elsewhere(env, ctx, path, old)}") from None
    write_text(env, path, fmt, after)
    ctx.changed(path)
    return _change_report(env, path, fmt.show(before), fmt.show(after), "edited")


def _unread(env: Environment, path: Path, old: str | None) -> str:
    """The refusal of an edit to an unread file, naming the read_file call to make: around
    old_string if the file has it, else from the top."""
    rel = env.relative(path)
    text = shown_text(env, path) or ""
    at = text.find(old) if isinstance(old, str) and old else -1
    first = text.count("\n", 0, at) + 1 if at >= 0 else 1
    last = first + str(old).count("\n") if at >= 0 else MAX_READ_LINES - MARGIN
    return (f"read {rel} with read_file first: call {read_call(rel, first, last)}, then copy "
            "old_string exactly from its output")


def _replace(text: str, old: str | None, new: str | None, replace_all: bool) -> str:
    if old is None or new is None:
        raise ToolError("pass old_string and new_string (or code_edit)")
    if old == "":
        raise ToolError("old_string is empty; use create_file to write a whole file")
    if old == new:
        raise ToolError("old_string and new_string are identical; nothing to change")
    count = text.count(old)
    if count == 0 and (start := _unique_ignoring_quotes(text, old)) is not None:
        return text[:start] + new + text[start + len(old):]
    if count == 0:
        hint = ""
        if " ".join(old.split()) in " ".join(text.split()):
            hint = " (it matches if whitespace is ignored: copy the indentation exactly)"
        raise ToolError(f"old_string was not found in the file{hint}; read_file the file "
                        "and copy the text exactly")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times; include more surrounding lines to "
                        "make it unique, or set replace_all to true")
    return text.replace(old, new) if replace_all else text.replace(old, new, 1)


def _found_elsewhere(env: Environment, ctx: ToolContext, path: Path, old: str | None) -> str:
    """Small models often edit the test file with a line from the code it imports (or the
    reverse); if old_string is missing here but in exactly one other file this run read,
    say which."""
    if not old or old in read_text(env, path).text:
        return ""
    others = [p for p in sorted(ctx.seen) if p != path and old in text_or_empty(env, p)]
    return f" (it does occur in {env.relative(others[0])}: edit that file)" \
        if len(others) == 1 else ""


def _unique_ignoring_quotes(text: str, old: str) -> int | None:
    """Where `old` occurs once if ' and " are the same character (models often switch quote
    style when copying, as Aider and Claude Code also tolerate). The mapping is one character
    to one, so offsets in the normalised text are offsets in the file."""
    table = str.maketrans("'", '"')
    haystack, needle = text.translate(table), old.translate(table)
    start = haystack.find(needle)
    if start == -1 or haystack.find(needle, start + 1) != -1:
        return None
    return start


def _apply_sketch(before: str, sketch: str, rel: str, ctx: ToolContext) -> str:
    result = ctx.services.apply.merge(before, sketch, rel)
    if not result.ok or result.merged is None:
        detail = "; ".join(result.diagnostics) or "merge failed"
        raise ToolError(f"could not apply code_edit ({detail}); use old_string/new_string")
    return result.merged


@tool("create_file", "Create a file (and its directories) with the given content, or "
      "overwrite an existing file completely.",
      {"path": PATH, "content": {"type": "string"}}, ("path", "content"), "write",
      inline=True)
def create_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"], write=True)
    kind = kind_of(env, path)
    if kind == "dir":
        raise ToolError(f"{args['path']} is a directory")
    exists = kind is not None
    if exists and needs_read(ctx, path):
        raise ToolError(f"{env.relative(path)} already exists; read it with read_file first, "
                        "then change it with edit_file (or overwrite it with create_file)")
    fmt = read_text(env, path) if exists else TextFile("", "utf-8")  # an overwrite keeps the format
    content = fmt.incoming(args["content"])
    write_text(env, path, fmt, content)
    ctx.seen.add(path)
    ctx.changed(path)
    return _change_report(env, path, fmt.shown, fmt.show(content),
                          "overwrote" if exists else "created")


@tool("delete_file", "Delete a file.", {"path": PATH}, ("path",), "write", inline=True)
def delete_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"], write=True)
    kind = kind_of(env, path)
    if path == env.root or kind == "dir":
        raise ToolError(f"{args['path']} is a directory; only files can be deleted")
    if kind is None:
        raise ToolError(f"{args['path']} does not exist")
    try:  # the diff shows what was lost; a binary or huge file is deleted without one
        before = read_text(env, path).shown
    except ToolError:
        before = ""
    try:
        env.workspace.remove(path)
    except Refused as exc:
        raise ToolError(str(exc)) from None
    ctx.changed(path)
    diff = _diff(env.relative(path), before, "")
    return f"deleted {env.relative(path)}", {"diff": diff, "path": env.relative(path)}


def _change_report(env: Environment, path: Path, before: str, after: str,
                   verb: str) -> tuple[str, dict]:
    rel = env.relative(path)
    diff = _diff(rel, before, after)
    added = sum(1 for ln in diff.splitlines() if ln[:1] == "+" and ln[:3] != "+++")
    removed = sum(1 for ln in diff.splitlines() if ln[:1] == "-" and ln[:3] != "---")
    text = f"{verb} {rel} (+{added} -{removed} lines)"
    errors = syntax_errors(path, after)
    if errors:
        text += "\nwarning: the file now has syntax errors:\n" + "\n".join(errors[:5])
    return text, {"diff": diff, "path": rel, "syntax_errors": errors}


def _diff(rel: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"a/{rel}", f"b/{rel}"))
