"""What several tools share: workspace files through `env.workspace` (read, write, list,
kind), the read-before-edit rule and the read_file call that satisfies it, and syntax checks."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.toolset import ToolContext
from codeplane.core import languages
from codeplane.core.files import Refused, TextFile, TooLarge, decode
from codeplane.sandbox.workspace import Entry, FileStat

MAX_FILE_BYTES = 8 << 20  # larger files are refused before reading (logs, data, sparse files)


MAX_READ_LINES = 400


MARGIN = 20  # lines of context either side of a hit in the suggested read


_SKIP_DIRS = {".git", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache",
              ".pytest_cache", ".ruff_cache"}


PATH = {"type": "string", "description": "Path relative to the workspace root."}


def kind_of(env: Environment, path: Path) -> str | None:
    """What is at a resolved path ("file", "dir", "symlink", "other"), None for nothing."""
    st: FileStat | None = env.workspace.stat(path)
    return st.kind if st else None


def is_file(env: Environment, rel: str) -> bool:
    try:
        return kind_of(env, env.resolve(rel)) == "file"
    except (ToolError, ValueError, OSError):  # outside the workspace, or not a path at all
        return False


def read_text(env: Environment, path: Path) -> TextFile:
    """A workspace file through the workspace (local backends: the one resolver,
    core/files.py): a regular file inside it, not larger than MAX_FILE_BYTES, not
    binary."""
    try:
        return decode(env.workspace.read(path, MAX_FILE_BYTES), path.name)
    except TooLarge as exc:
        raise ToolError(f"{exc}; look at parts of it with grep, or run_terminal_cmd with "
                        "head/sed -n") from None
    except Refused as exc:
        raise ToolError(str(exc)) from None
    except FileNotFoundError:
        raise ToolError(f"{path.name} does not exist") from None
    except OSError as exc:
        raise ToolError(f"cannot read {path.name}: {exc.strerror}") from None


def shown_text(env: Environment, path: Path) -> str | None:
    """A file's text as the model sees it, or None when it cannot be read (gone, binary,
    too large, outside the workspace)."""
    try:
        return read_text(env, path).shown
    except ToolError:
        return None


def text_or_empty(env: Environment, path: Path) -> str:
    """A file's text for a hint, or "" when it cannot be read."""
    try:
        return read_text(env, path).text
    except ToolError:
        return ""


def write_text(env: Environment, path: Path, fmt: TextFile, text: str) -> None:
    """Encode as the file was and replace it atomically through the resolver."""
    try:
        data = fmt.encode(text)
    except ValueError as exc:
        raise ToolError(f"{exc}; nothing was written (keep to characters the file's "
                        "encoding has, or use an escape sequence)") from None
    try:
        env.workspace.write(path, data)
    except Refused as exc:
        raise ToolError(f"{exc}; nothing was written") from None


def split_lines(text: str) -> list[str]:
    """Lines split at "\n" only: `str.splitlines` also splits at form feeds and at U+0085
    (a plain byte in Latin-1 files), which would shift line numbers against the editor."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def missing(env: Environment, given: str) -> ToolError:
    """A not-found error that names the workspace files the model probably meant."""
    name = Path(given).name
    files = list(list_files(env, env.root))
    close = [f for f in files if Path(f).name == name] or [
        f for f in files if name and name.split(".")[0] in Path(f).name][:3]
    hint = f"; did you mean {' or '.join(close[:3])}?" if close else \
        "; use list_dir or file_search to find files"
    return ToolError(f"{given} does not exist{hint}")


def mentioned(text: str, files: list[str]) -> list[str]:
    """Workspace files a task names, by path or by an unambiguous file name, in the order
    they appear in the text."""
    by_name: dict[str, list[str]] = {}
    for f in files:
        by_name.setdefault(Path(f).name, []).append(f)
    found: dict[str, int] = {}
    for f in files:
        names = [f] + ([Path(f).name] if len(by_name[Path(f).name]) == 1 else [])
        for name in names:
            m = re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w/-])", text)
            if m:
                found[f] = min(found.get(f, m.start()), m.start())
    return sorted(found, key=found.__getitem__)


def strip_dot(line: str) -> str:
    return line.removeprefix("./")


def list_files(env: Environment, base: Path, use_rg: bool = True) -> Iterator[str]:
    """Workspace-relative paths of files under base; ripgrep (in the sandbox) honours
    .gitignore."""
    rg = shutil.which("rg") if use_rg else None
    if rg:
        res = env.exec([rg, "--files", "--null", "--", env.relative(base)])
        if res.killed:
            raise ToolError(f"listing files failed ({res.killed})")
        yield from sorted(strip_dot(p) for p in res.output.split("\0") if p)
        return
    kind = kind_of(env, base)
    if kind != "dir":
        yield from [env.relative(base)] if kind else []
        return
    # depth first in name order, iteratively: a tree 1,000 directories deep must not exhaust
    # the interpreter's stack (symlinked directories are not entered)
    stack = [(base, _listing(env, base))]
    while stack:
        folder, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
        elif entry.stat.kind != "dir":
            yield env.relative(folder / entry.name)
        elif entry.name not in _SKIP_DIRS and entry.name[0] != ".":
            stack.append((folder / entry.name, _listing(env, folder / entry.name)))


def _listing(env: Environment, folder: Path) -> Iterator[Entry]:
    """A folder's entries; none for one that cannot be listed (past PATH_MAX, gone)."""
    try:
        return iter(env.workspace.list(folder))
    except (Refused, OSError):
        return iter(())


def needs_read(ctx: ToolContext, path: Path) -> bool:
    """Would a change to path be refused as not read in this run? (the read-before-edit rule)"""
    return ctx.read_before_edit and path not in ctx.seen


def unread_file(env: Environment, ctx: ToolContext, rel: str) -> bool:
    """`needs_read` for a path as a hit names it."""
    try:
        return needs_read(ctx, env.resolve(rel))
    except (ToolError, ValueError, OSError):  # not a workspace path after all
        return False


def next_step(rel: str, first: int, last: int) -> str:
    return (f"[next: to change {rel}, call {read_call(rel, first, last)} first; edit_file "
            "needs the file read in this run, and a search hit is not a read]")


def read_call(rel: str, first: int, last: int) -> str:
    """The read_file call that shows lines first..last of rel with some context, written as
    the model would call it, so it can copy it instead of guessing."""
    args = {"path": rel, "start_line": max(first - MARGIN, 1), "end_line": last + MARGIN}
    return f"read_file {json.dumps(args)}"


def syntax_errors(path: Path, source: str, rel: str | None = None) -> list[str]:
    """Syntax errors in `source` (the text of `path`) via tree-sitter (Python: the
    compiler), as 'path:line:col: message'."""
    rel = rel or path.name
    if path.suffix == ".py":
        try:
            compile(source, rel, "exec")
            return []
        except SyntaxError as exc:
            return [f"{rel}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}"]
    language = languages.language_for(path.name)
    if language is None:
        return []
    return [f"{rel}:{e.line}:{e.column}: syntax error" + (f": missing {e.missing}" if e.missing
                                                          else "")
            for e in languages.syntax_errors(source, language)]
