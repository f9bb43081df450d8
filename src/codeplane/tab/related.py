"""Client side of Tab's workspace context: definitions of the names used near the cursor.

The server sees a window of the current file; what the model most often lacks is the signature
of a function or class defined in another file, or far away in this one (`self._parse(`,
`Headers(` ...). The client finds those definitions with tree-sitter (the grammar pack the
indexer uses) over the files it already has - open documents and workspace files - and sends
their first lines as context snippets. Nothing leaves the machine that the editor does not hold.

Stability matters more than freshness: the snippets are the head of the prompt, so any change
there makes the server recompute the whole file window (seconds on CPU). Names are
therefore read from the `QUANTUM`-line block around the cursor minus the cursor's own line,
and `Related` freezes the choice while the cursor stays in that block: typing on a line never
changes the context, moving into a new block may.
"""

from __future__ import annotations

import hashlib
import keyword
import os
import re
from dataclasses import dataclass
from pathlib import Path

from codeplane.core.languages import DEF_TYPES, code_language, parser
from codeplane.tab.context import CHARS_PER_TOKEN, QUANTUM, Excerpt

DEF_LINES = 6  # a definition is sent as its first lines: the signature and docstring start
MAX_PER_NAME = 2  # a name defined in more places than this is too ambiguous to help
MAX_FILE_BYTES = 256_000  # workspace files larger than this are generated, not read
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SKIP = frozenset(keyword.kwlist) | {"self", "cls", "None", "True", "False", "print", "len",
                                     "str", "int", "dict", "list", "set", "tuple", "isinstance"}
_SKIP_DIRS = frozenset({".git", "node_modules", "__pycache__", ".venv", "venv", "build",
                        "dist", "site-packages", ".tox", ".mypy_cache"})


@dataclass(frozen=True)
class Definition:
    path: str
    name: str
    start: int  # 0-based first line
    end: int  # 0-based last line
    text: str  # what is sent: the enclosing class line (if any) and the first DEF_LINES


class WorkspaceDefs:
    """Definitions by name over the files the client holds; a file is re-parsed only when its
    text changed. One instance per editor session."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[str, list[Definition]]] = {}  # path -> (digest, defs)
        self._by_name: dict[str, list[Definition]] | None = None

    def add(self, path: str, text: str) -> None:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        if self._files.get(path, ("",))[0] != digest:
            self._files[path] = (digest, self._parse(path, text))
            self._by_name = None

    def scan(self, root: Path, like: str, limit: int = 500) -> int:
        """Add up to `limit` workspace files in the language of `like` (skipping vendored and
        build directories); returns how many were read."""
        language = code_language(like)
        count = 0
        for top, dirs, names in os.walk(root):  # not rglob: skipped trees are never walked
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            for name in sorted(names):
                path = Path(top, name)
                if count >= limit or language is None or code_language(name) != language:
                    continue
                try:
                    if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                        continue
                    self.add(path.relative_to(root).as_posix(), path.read_text())
                except (OSError, UnicodeDecodeError):
                    continue
                count += 1
        return count

    def lookup(self, name: str) -> list[Definition]:
        if self._by_name is None:
            self._by_name = {}
            for _, defs in self._files.values():
                for d in defs:
                    self._by_name.setdefault(d.name, []).append(d)
        return self._by_name.get(name, [])

    def _parse(self, path: str, text: str) -> list[Definition]:
        language = code_language(path)
        if language is None:
            return []
        try:
            tree = parser(language).parse(text.encode("utf-8", "surrogatepass"))
        except (LookupError, ValueError, RuntimeError):
            return []  # grammar missing from this build: no definitions, no error
        lines = text.split("\n")
        out: list[Definition] = []
        stack = [(tree.root_node, "")]
        while stack:
            node, outer = stack.pop()
            for child in node.children:
                name = child.child_by_field_name("name") if child.type in DEF_TYPES else None
                if name is None:
                    stack.append((child, outer))
                    continue
                start, end = child.start_point[0], child.end_point[0]
                body = "\n".join(lines[start:min(end, start + DEF_LINES - 1) + 1])
                out.append(Definition(path, name.text.decode(errors="replace"), start, end,
                                      f"{outer}\n{body}" if outer else body))
                stack.append((child, lines[start].rstrip()))
        return out


def names_near(text: str, line: int) -> list[str]:
    """Identifiers used in the `QUANTUM`-line block around 0-based `line` and the block
    before it, except on `line` itself; nearest first."""
    lines = text.split("\n")
    first = max(0, (line // QUANTUM - 1) * QUANTUM)
    last = min(len(lines), (line // QUANTUM + 1) * QUANTUM)
    order = sorted((n for n in range(first, last) if n != line), key=lambda n: abs(n - line))
    out: dict[str, None] = {}
    for n in order:
        for name in _IDENT.findall(lines[n]):
            if name not in _SKIP and len(name) > 2:
                out.setdefault(name, None)
    return list(out)


def related(path: str, text: str, line: int, defs: WorkspaceDefs, window: tuple[int, int],
            budget_tokens: int) -> list[Excerpt]:
    """Definitions of the names near `line`, nearest name first, within the budget; those
    inside `window` (0-based lines of `path` the server already gets) are left out."""
    defs.add(path, text)
    left = budget_tokens * CHARS_PER_TOKEN
    out: list[Excerpt] = []
    for name in names_near(text, line):
        found = defs.lookup(name)
        if not found or len(found) > MAX_PER_NAME:
            continue
        for d in found:
            inside = d.path == path and d.start <= window[1] and d.end >= window[0]
            if inside or len(d.text) > left or any(c.text == d.text for c in out):
                continue
            out.append(Excerpt(d.path, d.text))
            left -= len(d.text)
    return out


class Related:
    """`related` frozen per (file, block): the context stays byte-identical while the cursor
    stays within one `QUANTUM`-line block, so the server's KV cache keeps covering it."""

    def __init__(self, defs: WorkspaceDefs) -> None:
        self.defs = defs
        self._memo: tuple[str, int, list[Excerpt]] | None = None

    def for_cursor(self, path: str, text: str, offset: int, window: tuple[int, int],
                   budget_tokens: int) -> list[Excerpt]:
        line = text.count("\n", 0, offset)
        block = line // QUANTUM
        if self._memo and self._memo[:2] == (path, block):
            return self._memo[2]
        chunks = related(path, text, line, self.defs, window, budget_tokens)
        self._memo = (path, block, chunks)
        return chunks
