"""The failing-test task family: "make the failing test pass", from real public code.

A task is a repository snapshot in which one function's body is broken by one deterministic,
verifiable mutation (a flipped comparison, `and`/`or` swapped, `+`/`-` swapped, a 0/1
constant swapped), plus a test file generated from the doctests of that module's functions
(the examples their authors wrote, embedded in the test file as text: editing the docstring
cannot change the test). The mutation is the first one, in source order, that makes that
function's test fail; a function whose doctest does not pass on the unbroken code is never
used. The instruction names the failing test and the file; the verifier writes the test file
back as generated (so deleting or editing it gains nothing) and runs it **inside the
episode's sandbox**: reward 1 when every test of the file passes, else 0.

Building a task runs the project's code, so that too happens in a sandbox (the same workspace
backends the environment servers use), never on the host. Built tasks are cached with their
snapshots under `~/.codeplane/rl/testfix/<project>/` (`tasks.json`), so a second run starts
at once. The train/held-out split is by project, as for the locate family.

Python's own `ast` finds the functions and the operators (exact spans; no grammar package),
and `doctest` reads the examples: the standard library does all the parsing here.
"""

from __future__ import annotations

import ast
import doctest
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from codeplane.agent.env import Environment
from codeplane.sandbox import DEFAULT_BACKEND, Limits, open_workspace

TEST_DIR = "doctest_tests"
MAX_SOURCE_BYTES = 256 << 10  # larger files are generated code
TEST_TIMEOUT = 30.0  # seconds for one run of a test file in the sandbox (a flipped loop
# condition may never end: it is killed, and a task whose mutation hangs is not made)
_RESULT = re.compile(r"^(test_\w+) \(.*?\) \.\.\. (ok|FAIL|ERROR|skipped.*)$", re.MULTILINE)
# operator flips: (ast node type, source token pattern, replacement text)
_COMPARE = {ast.Lt: ("<", ">="), ast.GtE: (">=", "<"), ast.Gt: (">", "<="),
            ast.LtE: ("<=", ">"), ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="),
            ast.In: (r"\bin\b", "not in"), ast.NotIn: (r"\bnot\s+in\b", "in"),
            ast.Is: (r"\bis\b", "is not"), ast.IsNot: (r"\bis\s+not\b", "is")}
_BOOL = {ast.And: (r"\band\b", "or"), ast.Or: (r"\bor\b", "and")}
_BIN = {ast.Add: (r"\+", "-"), ast.Sub: ("-", "+")}


@dataclass(frozen=True)
class FixTask:
    """One task: `snapshot` is the broken repository (each episode copies it); the test file
    `test_path` (relative) has `tests` tests, `test_name` fails on the snapshot, and
    `test_source` is the file's text, which the verifier restores before running it."""

    id: str
    repo: str
    snapshot: str
    instruction: str
    path: str  # the file with the broken function
    function: str  # its qualified name
    mutation: str  # what was broken, e.g. "line 12: < -> >="
    test_path: str
    test_name: str
    tests: int
    test_source: str


@dataclass(frozen=True)
class Mutation:
    """Replace bytes `start`..`end` of the file with `new`: one operator or constant."""

    start: int
    end: int
    new: str
    line: int
    old: str

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.new.encode() + source[self.end:]

    def describe(self) -> str:
        return f"line {self.line}: {self.old.strip()} -> {self.new}"


@dataclass(frozen=True)
class Doctested:
    """A function with doctest examples: where it is and its docstring's text."""

    path: str  # relative file
    module: str  # dotted module name
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    docstring: str


def run_fix_test(task: FixTask, env: Environment, repo: Path) -> float:
    """The verifier: the test file restored as generated, run in the episode's sandbox;
    1.0 when all `task.tests` tests pass, else 0.0."""
    test = repo / task.test_path
    test.parent.mkdir(parents=True, exist_ok=True)
    test.unlink(missing_ok=True)  # a symlink the policy planted is replaced, not followed
    test.write_text(task.test_source)
    results = test_results(env, task.test_path)
    return float(len(results) == task.tests and all(r == "ok" for r in results.values()))


def test_results(env: Environment, test_path: str) -> dict[str, str]:
    """Each test's outcome ("ok", "FAIL", "ERROR", "skipped ...") from one run of the test
    file in the environment's sandbox ({} when the file could not even run)."""
    result = env.run(f"PYTHONDONTWRITEBYTECODE=1 python {test_path} -v", TEST_TIMEOUT)
    if result.exit_code is None or result.killed:
        return {}
    return dict(_RESULT.findall(result.output))


def fix_tasks(repo: str, root: Path, cache: Path, backend: str = DEFAULT_BACKEND,
              per_module: int = 4) -> list[FixTask]:
    """The project's tasks, built once (in sandboxes) and cached under `cache/testfix/`
    by the project's name and a digest of its Python sources (a local directory that
    changed is built again): for each module with doctests, at most `per_module` broken
    functions."""
    home = cache / "testfix" / f"{repo}-{_digest(root)}"
    manifest = home / "tasks.json"
    if manifest.exists():
        return [FixTask(**t) for t in json.loads(manifest.read_text())]
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    tasks: list[FixTask] = []
    by_module: dict[str, list[Doctested]] = {}
    for fn in doctested(root):
        by_module.setdefault(fn.module, []).append(fn)
    for module, fns in sorted(by_module.items()):
        tasks += _module_tasks(repo, root, home, module, fns, backend, per_module)
    manifest.write_text(json.dumps([asdict(t) for t in tasks], indent=1))
    return tasks


def _module_tasks(repo: str, root: Path, home: Path, module: str, fns: list[Doctested],
                  backend: str, per_module: int) -> list[FixTask]:
    """Tasks for one module: its doctests that pass on the unbroken code form the test
    file; each function then gets the first mutation that makes its own test fail."""
    test_path = f"{TEST_DIR}/test_{module.replace('.', '_')}.py"
    base = home / "base"
    _snapshot(root, base, test_path, test_file(module, _import_root(root, fns[0].path), fns))
    passing = {name for name, r in _run(base, test_path, backend).items() if r == "ok"}
    shutil.rmtree(base)
    fns = [f for f in fns if _test_name(f.qualname) in passing]
    if not fns:
        return []
    source_text = test_file(module, _import_root(root, fns[0].path), fns)
    tasks: list[FixTask] = []
    for fn in fns:
        if len(tasks) >= per_module:
            break
        original = (root / fn.path).read_bytes()
        for mutation in mutations(fn.node, original):
            digest = hashlib.sha256(f"{repo}\0{fn.path}\0{fn.qualname}\0{mutation.start}"
                                    .encode()).hexdigest()[:12]
            snap = home / digest
            _snapshot(root, snap, test_path, source_text)
            (snap / fn.path).write_bytes(mutation.apply(original))
            if _run(snap, test_path, backend).get(_test_name(fn.qualname)) in ("FAIL",
                                                                               "ERROR"):
                tasks.append(FixTask(
                    f"{repo}:{digest}", repo, str(snap), instruction(test_path, fn), fn.path,
                    fn.qualname, mutation.describe(), test_path, _test_name(fn.qualname),
                    len(fns), source_text))
                break
            shutil.rmtree(snap)
    return tasks


def instruction(test_path: str, fn: Doctested) -> str:
    """What the policy is told: the failing test and how to run it, not where the bug is."""
    return (f"The test {_test_name(fn.qualname)} in {test_path} fails. Make it pass: find "
            "and fix the bug in the code it tests; do not change the test file. Run the tests "
            f"with: python {test_path}")


def doctested(root: Path) -> Iterator[Doctested]:
    """Functions (top level, or methods of top-level classes) whose docstrings have doctest
    examples, in file order; test, setup and documentation files are skipped."""
    parser = doctest.DocTestParser()
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root)
        if (any(p.startswith(".") or p in ("tests", "test", "docs", "doc", "build",
                                          "examples", "benchmarks") for p in rel.parts)
                or rel.name.startswith(("test_", "conftest", "setup"))
                or file.stat().st_size > MAX_SOURCE_BYTES):
            continue
        module = _module_name(root, rel)
        if module is None:
            continue
        try:
            tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node, qualname in functions(tree):
            doc = ast.get_docstring(node, clean=False) or ""
            if doc and parser.get_examples(doc):
                yield Doctested(rel.as_posix(), module, qualname, node, doc)


def mutations(node: ast.AST, source: bytes) -> Iterator[Mutation]:
    """Single-token mutations inside `node`'s body, in source order: each flips one
    comparison, `and`/`or`, `+`/`-`, or a 0/1 integer constant (nested functions are the
    function's code too)."""
    starts = _line_starts(source)

    def offset(line: int, col: int) -> int:
        return starts[line - 1] + col  # ast columns are UTF-8 byte offsets

    found: list[Mutation] = []
    for sub in ast.walk(node):
        pairs: list[tuple[ast.AST, ast.AST, str, str]] = []
        if isinstance(sub, ast.Compare):
            left = [sub.left, *sub.comparators]
            pairs = [(a, b, *_COMPARE[type(op)]) for a, b, op
                     in zip(left, left[1:], sub.ops, strict=False) if type(op) in _COMPARE]
        elif isinstance(sub, ast.BoolOp):
            pairs = [(a, b, *_BOOL[type(sub.op)]) for a, b in zip(sub.values, sub.values[1:],
                                                                   strict=False)]
        elif isinstance(sub, ast.BinOp) and type(sub.op) in _BIN:
            pairs = [(sub.left, sub.right, *_BIN[type(sub.op)])]
        elif (isinstance(sub, ast.Constant) and type(sub.value) is int
              and sub.value in (0, 1) and sub.end_col_offset is not None):
            start, end = offset(sub.lineno, sub.col_offset), offset(sub.end_lineno or
                                                                    sub.lineno,
                                                                    sub.end_col_offset)
            if source[start:end] in (b"0", b"1"):
                found.append(Mutation(start, end, "1" if sub.value == 0 else "0", sub.lineno,
                                      source[start:end].decode()))
        for a, b, pattern, new in pairs:
            gap_start = offset(a.end_lineno or a.lineno, a.end_col_offset or 0)
            gap = source[gap_start:offset(b.lineno, b.col_offset)].decode(errors="replace")
            m = re.search(pattern, gap.split("#")[0])
            if m:
                found.append(Mutation(gap_start + len(gap[:m.start()].encode()),
                                      gap_start + len(gap[:m.end()].encode()), new,
                                      a.end_lineno or a.lineno, m.group()))
    yield from sorted(found, key=lambda m: m.start)


def test_file(module: str, import_root: str, fns: list[Doctested]) -> str:
    """A unittest file with one test per function: its doctest examples, embedded as text,
    run against the module's globals (as `doctest` runs a module's own examples)."""
    docs = {f.qualname: f.docstring for f in fns}
    tests = "".join(f"\n    def {_test_name(q)}(self):\n        check({q!r})\n" for q in docs)
    return f'''"""Doctests of {module}, one test per function (the examples its authors wrote).
Generated by codeplane's rl testfix task family."""

import doctest
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / {import_root!r}))
import {module} as module  # noqa: E402

DOCSTRINGS = {json.dumps(docs, indent=1)}


def check(qualname):
    test = doctest.DocTestParser().get_doctest(DOCSTRINGS[qualname], dict(vars(module)),
                                               qualname, module.__file__, 0)
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.attempted and not result.failed, "".join(report)


class Doctests(unittest.TestCase):
{tests}

if __name__ == "__main__":
    unittest.main()
'''


def _test_name(qualname: str) -> str:
    return "test_" + qualname.replace(".", "_")


def functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef,
                                                  str]]:
    """Top-level functions and the methods of top-level classes, with qualified names."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, node.name
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield sub, f"{node.name}.{sub.name}"


def _module_name(root: Path, rel: Path) -> str | None:
    """The dotted import name of a file inside packages (None for loose scripts)."""
    parts = [rel.stem] if rel.name != "__init__.py" else []
    parent = rel.parent
    while parent != Path(".") and (root / parent / "__init__.py").exists():
        parts.insert(0, parent.name)
        parent = parent.parent
    if not parts or len(parts) == 1 and rel.parent == parent:
        return None  # not inside a package
    return ".".join(parts)


def _import_root(root: Path, rel: str) -> str:
    """The directory (relative to the repository) that must be on sys.path: the parent of
    the file's top package ("src" in a src layout, "." otherwise)."""
    parent = Path(rel).parent
    while parent != Path(".") and (root / parent / "__init__.py").exists():
        parent = parent.parent
    return parent.as_posix()


def _digest(root: Path) -> str:
    """A digest of the repository's Python files (paths and contents)."""
    h = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        h.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:12]


def _line_starts(source: bytes) -> list[int]:
    starts, pos = [0], 0
    for line in source.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _snapshot(root: Path, dest: Path, test_path: str, test_source: str) -> None:
    shutil.copytree(root, dest, symlinks=True)
    (dest / test_path).parent.mkdir(parents=True, exist_ok=True)
    (dest / test_path).write_text(test_source)


def _run(repo: Path, test_path: str, backend: str) -> dict[str, str]:
    """A test file's results on `repo`, run in a sandbox of `backend` (the project's code
    never runs on the host)."""
    with sandboxed(repo, backend) as env:
        return test_results(env, test_path)


@contextmanager
def sandboxed(repo: Path, backend: str) -> Iterator[Environment]:
    """An environment over `repo` in a sandbox of `backend`, where building a task runs
    the project's code (closed after)."""
    env = Environment(open_workspace(repo, backend), Limits(timeout=TEST_TIMEOUT))
    try:
        yield env
    finally:
        env.close()
