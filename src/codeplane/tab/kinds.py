"""Next edits that need no model: each function reads the user's recent edits and the file and
proposes the one follow-up change its kind implies, or None.

The base model gives no exact next edit on the held-out cases (docs/tab.md, "Next edit"), and
the trained adapter is compute-blocked, so these rules answer what a rule can: the same
change again (`same_change`), the change made on a line that differs from the edited one in
one name (`parallel_change`), a parameter added to a `def` passed at its next call
(`argument_added`), and an import whose last use an edit removed deleted (`import_unused`).
Each kind is kept only while it keeps precision >= 0.5 on the tuning repositories
(docs/tab.md, "Next edits without a model", has the table). The tree-sitter kinds read
Python only; the line kinds read any text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any, Protocol

from codeplane.core.languages import code_language, parser

MAX_BLOCK_LINES = 4  # an edit of more lines is not repeated elsewhere as it is
NEAR_LINES = 10  # the line kinds look this far from the cursor (next edit's window)
_TOKEN = re.compile(r"\w+|\s+|\W")
_WORD = re.compile(r"\w*[^\W\d]\w*")


class Edit(Protocol):
    """One recent edit (`nextedit.EditIn`): lines from `line` (0-based, after it) were
    `before` and are now `after`."""

    path: str
    line: int
    before: str
    after: str


@dataclass
class Suggestion:
    """Replace lines [start_line, end_line) (0-based) of the file with `text`."""

    start_line: int
    end_line: int
    text: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        return "".join(lines[:self.start_line]) + self.text + "".join(lines[self.end_line:])


Kind = Callable[[str, str, int, list[Edit]], Suggestion | None]


def nearest(spots: list[int], cursor: int) -> int:
    """The place to go: the first at or after the cursor's line, else the last before it
    (the one-word baseline's order)."""
    after = [n for n in spots if n >= cursor]
    return after[0] if after else spots[-1]


# -- the line kinds: the newest edit's change again -----------------------------------------


def same_change(path: str, text: str, cursor: int, edits: list[Edit]) -> Suggestion | None:
    """The newest edit's old lines found again (indented alike or not): the same change
    there (`@task` -> `@task()` at the next `@task`)."""
    return _repeat(text, cursor, edits, renamed=False)


def parallel_change(path: str, text: str, cursor: int, edits: list[Edit]
                    ) -> Suggestion | None:
    """Lines that are the newest edit's old lines but for one name: the edit's new lines
    with that name (`if not value1:` -> `if value1 is None:`, so `if not value2:` ->
    `if value2 is None:`)."""
    return _repeat(text, cursor, edits, renamed=True)


def _repeat(text: str, cursor: int, edits: list[Edit], renamed: bool) -> Suggestion | None:
    if not edits:
        return None
    e = edits[-1]
    before, after = e.before.splitlines(keepends=True), e.after.splitlines(keepends=True)
    if not before or len(before) > MAX_BLOCK_LINES or before == after \
            or not re.search(r"\w\w", e.before):
        return None
    lines = text.splitlines(keepends=True)
    own = range(e.line, e.line + max(len(after), 1))  # the edit's own lines are done
    places = range(max(0, cursor - NEAR_LINES), min(len(lines) - len(before), cursor + NEAR_LINES) + 1)
    found = {at: new for at in places if at not in own
             if (new := _redone(lines[at:at + len(before)], before, after, renamed))}
    if not found:
        return None
    at = nearest(sorted(found), cursor)
    return Suggestion(at, at + len(before), found[at])


def _redone(place: list[str], before: list[str], after: list[str], renamed: bool
            ) -> str | None:
    """`after` as it would read at `place` when `place` is `before` shifted to another
    indentation - and, if `renamed`, with exactly one name in it another."""
    old, new = _indent(before[0]), _indent(place[0])
    shifted = _shift(before, old, new)
    moved = _shift(after, old, new)
    if shifted is None or moved is None:
        return None
    if not renamed:
        return "".join(moved) if shifted == place else None
    swap = _one_name(shifted, place)
    if swap is None or not re.search(rf"(?<!\w){re.escape(swap[0])}(?!\w)", "".join(moved)):
        return None
    return re.sub(rf"(?<!\w){re.escape(swap[0])}(?!\w)", swap[1], "".join(moved))


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]


def _shift(lines: list[str], old: str, new: str) -> list[str] | None:
    """`lines` moved from indentation `old` to `new`; None if one is indented less."""
    out = []
    for line in lines:
        if not line.strip():
            out.append(line)
        elif line.startswith(old):
            out.append(new + line[len(old):])
        else:
            return None
    return out


def _one_name(a: list[str], b: list[str]) -> tuple[str, str] | None:
    """(old name, new name) when `b` is `a` with one name replaced by another."""
    x, y = _TOKEN.findall("".join(a)), _TOKEN.findall("".join(b))
    ops = [op for op in SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    if len(ops) != 1 or ops[0][0] != "replace" or ops[0][2] - ops[0][1] != 1 \
            or ops[0][4] - ops[0][3] != 1:
        return None
    old, new = x[ops[0][1]], y[ops[0][3]]
    return (old, new) if _WORD.fullmatch(old) and _WORD.fullmatch(new) else None


# -- the tree kinds (Python) -----------------------------------------------------------------


def _tree(path: str, text: str) -> Any | None:
    if code_language(path) != "python":
        return None
    return parser("python").parse(text.encode("utf-8", "surrogatepass"))


def _walk(node: Any) -> Iterator[Any]:
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def _name(node: Any) -> str:
    return node.text.decode("utf-8", "surrogatepass")


def argument_added(path: str, text: str, cursor: int, edits: list[Edit]) -> Suggestion | None:
    """A parameter an edit added to a `def`, passed at a call of that function inside a
    function that has a parameter of the same name (a recursive or forwarding call: the
    value is known) - by keyword when the parameter has a default."""
    tree = _tree(path, text)
    if tree is None:
        return None
    defs = [n for n in _walk(tree.root_node) if n.type == "function_definition"]
    for e in reversed(edits):
        for fn, param, keyword in _added_parameters(defs, e):
            found = {}
            for call in _calls(tree.root_node, _name(fn.child_by_field_name("name"))):
                if _takes(call, param) or param not in _parameters_around(call):
                    continue
                if (new := _passed(text, call, param, keyword)) is not None:
                    found[call.start_point[0]] = new
            if found:
                return found[nearest(sorted(found), cursor)]
    return None


def _added_parameters(defs: list[Any], e: Edit) -> Iterator[tuple[Any, str, bool]]:
    """(def, parameter name, has a default) for each parameter the edit `e` added to a
    `def` whose parameter list it touched."""
    rows = range(e.line, e.line + max(e.after.count("\n"), 1))
    for fn in defs:
        params = fn.child_by_field_name("parameters")
        if params.end_point[0] < rows.start or params.start_point[0] >= rows.stop:
            continue
        for p in params.named_children:
            name = _parameter_name(p)
            if name and _has_word(e.after, name) and not _has_word(e.before, name):
                yield fn, name, p.type in ("default_parameter", "typed_default_parameter")


def _parameter_name(p: Any) -> str | None:
    if p.type == "identifier":
        return _name(p)
    if p.type in ("default_parameter", "typed_default_parameter"):
        return _name(p.child_by_field_name("name"))
    if p.type == "typed_parameter" and p.named_children[0].type == "identifier":
        return _name(p.named_children[0])
    return None


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text) is not None


def _calls(root: Any, name: str) -> Iterator[Any]:
    """Calls of `name(...)` and `x.name(...)`."""
    for n in _walk(root):
        if n.type != "call":
            continue
        f = n.child_by_field_name("function")
        if f.type == "attribute":
            f = f.child_by_field_name("attribute")
        if f.type == "identifier" and _name(f) == name:
            yield n


def _takes(call: Any, param: str) -> bool:
    """The call already passes `param` (by keyword, or its name as an argument)."""
    for a in call.child_by_field_name("arguments").named_children:
        if a.type == "keyword_argument" and _name(a.child_by_field_name("name")) == param:
            return True
        if a.type == "identifier" and _name(a) == param:
            return True
    return False


def _parameters_around(call: Any) -> set[str]:
    """The parameter names of the function the call sits in."""
    node = call.parent
    while node is not None and node.type != "function_definition":
        node = node.parent
    if node is None:
        return set()
    return {n for p in node.child_by_field_name("parameters").named_children
            if (n := _parameter_name(p))}


def _passed(text: str, call: Any, param: str, keyword: bool) -> Suggestion | None:
    """The call's lines with `param` passed: before a `**` argument, else after the last
    argument (on a line of its own when the arguments are laid out one a line)."""
    args = call.child_by_field_name("arguments")
    items = [a for a in args.named_children if a.type != "comment"]
    if not keyword and any(a.type in ("keyword_argument", "list_splat", "dictionary_splat")
                           for a in items):
        return None  # a positional argument's place among these is not known
    given = f"{param}={param}" if keyword else param
    data = text.encode("utf-8", "surrogatepass")
    splat = [a for a in items if a.type == "dictionary_splat"]
    if splat:
        at, insert = splat[0].start_byte, f"{given}, "
    elif not items:
        at, insert = args.start_byte + 1, given
    else:
        last = items[-1]
        closing = args.end_point[0]
        if closing == last.end_point[0] and last.start_point[0] == args.start_point[0]:
            at, insert = last.end_byte, f", {given}"
        elif closing == last.end_point[0]:  # hanging: one argument a line, `)` after the last
            at, insert = last.end_byte, f",\n{' ' * last.start_point[1]}{given}"
        else:  # `)` on a line of its own: a line before it, trailing comma kept
            comma = data[last.end_byte:last.end_byte + 1] == b","
            at = last.end_byte + (1 if comma else 0)
            insert = ("" if comma else ",") + f"\n{' ' * last.start_point[1]}{given},"
    new = (data[:at] + insert.encode() + data[at:]).decode("utf-8", "surrogatepass")
    first, last_row = call.start_point[0], args.end_point[0]
    added = insert.count("\n")
    new_lines = new.splitlines(keepends=True)[first:last_row + 1 + added]
    return Suggestion(first, last_row + 1, "".join(new_lines))


def import_unused(path: str, text: str, cursor: int, edits: list[Edit]) -> Suggestion | None:
    """An import of a name that a recent edit removed and that the file no longer uses
    anywhere else (in code, strings or comments): the import goes, or the name leaves it."""
    tree = _tree(path, text)
    if tree is None:
        return None
    gone = {w for e in edits for w in _WORD.findall(e.before) if not _has_word(e.after, w)}
    lines = text.splitlines(keepends=True)
    found = {}
    for stmt in tree.root_node.children:
        if stmt.type not in ("import_statement", "import_from_statement"):
            continue
        rows = range(stmt.start_point[0], stmt.end_point[0] + 1)
        rest = "".join(line for n, line in enumerate(lines) if n not in rows)
        for node, name in _bound(stmt):
            if name in gone and not _has_word(rest, name):
                found[rows.start] = _without(lines, stmt, node)
                break
    return found[nearest(sorted(found), cursor)] if found else None


def _bound(stmt: Any) -> list[tuple[Any, str]]:
    """(node, the name it binds) for each name an import statement imports."""
    names = stmt.children_by_field_name("name")
    out = []
    for n in names:
        if n.type == "aliased_import":
            out.append((n, _name(n.child_by_field_name("alias"))))
        elif stmt.type == "import_statement":
            out.append((n, _name(n).split(".")[0]))
        else:
            out.append((n, _name(n)))
    return out


def _without(lines: list[str], stmt: Any, node: Any) -> Suggestion:
    """The import statement without `node`'s name: deleted when it was its only one."""
    first, last = stmt.start_point[0], stmt.end_point[0]
    if len(_bound(stmt)) == 1:
        return Suggestion(first, last + 1, "")
    row = node.start_point[0]
    line = lines[row]
    if line.strip().rstrip(",") == _name(node) and row not in (first, last):
        return Suggestion(row, row + 1, "")  # one name a line: that line goes
    start, end = node.start_point[1], node.end_point[1]
    tail = re.match(r"\s*,\s*", line[end:])
    if tail:  # `a, b` -> `b`
        new = line[:start] + line[end + tail.end():]
    else:  # `a, b` -> `a`
        head = re.search(r",\s*$", line[:start])
        new = line[:head.start() if head else start] + line[end:]
    return Suggestion(row, row + 1, new)


KINDS: dict[str, Kind] = {"same": same_change, "parallel": parallel_change,
                          "argument": argument_added, "import": import_unused}
