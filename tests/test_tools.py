"""Agent tools on real files, real ripgrep/ruff/tree-sitter and a real sandbox; the tool
scheduler's concurrency rules; `codeplane tool`.

Every test that takes `env` runs once per workspace backend in the table (bwrap, host, and
whatever is added), so a backend that breaks a tool fails here."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from codeplane.agent import toolset as T
from codeplane.agent.env import Environment, local_environment
from codeplane.agent.loop import Agent, AgentConfig
from codeplane.agent.services import tool_services
from codeplane.agent.tools import default_toolset
from codeplane.cli import app
from codeplane.core.chat import HttpChatModel
from codeplane.sandbox import BACKENDS, Limits

execute = default_toolset().execute  # one call as the agent makes it

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"


@pytest.fixture(params=list(BACKENDS))
def env(request, tmp_path: Path, open_backend) -> Environment:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "calc.py").write_text(CALC)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "README.md").write_text("# demo\nadd and mul\n")
    (root / "web.js").write_text("function ok() { return 1; }\n")
    return Environment(open_backend(request.param, root), Limits(timeout=120.0))


def run(env, name, **args) -> T.ToolResult:
    return execute(env, name, args)


def test_registry_has_the_conventional_tools() -> None:
    names = {s["function"]["name"] for s in default_toolset().schemas()}
    assert names == {"read_file", "list_dir", "file_search", "grep", "codebase_search",
                     "edit_file", "create_file", "delete_file", "read_lints",
                     "run_terminal_cmd", "todo_write"}
    props = {s["function"]["name"]: s["function"]["parameters"]["properties"]
             for s in default_toolset().schemas()}
    assert {"old_string", "new_string", "path"} <= set(props["edit_file"])
    assert "command" in props["run_terminal_cmd"] and "todos" in props["todo_write"]
    assert "pattern" in props["grep"] and "query" in props["codebase_search"]


def test_read_file_ranges_and_truncation(env) -> None:
    res = run(env, "read_file", path="pkg/calc.py", start_line=5, end_line=6)
    assert res.ok and res.output == ("pkg/calc.py (lines 5-6 of 6):\n"
                                     "def mul(a, b):\n    return a * b")
    (env.root / "big.txt").write_text("".join(f"line {i}\n" for i in range(1, 1001)))
    res = run(env, "read_file", path="big.txt")
    assert "(lines 1-400 of 1000)" in res.output
    assert "call read_file with start_line=401" in res.output
    wide = execute(env, "read_file", {"path": "big.txt"}, max_chars=200)
    assert wide.truncated and len(wide.output) < 400
    assert "[truncated: showed" in wide.output and "start_line" in wide.output
    assert run(env, "read_file", path="pkg").output.startswith("error: pkg is a directory")


def test_paths_and_symlinks_cannot_escape(env, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    (env.root / "link.txt").symlink_to(secret)
    (env.root / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    attempts = [("read_file", {"path": "link.txt"}), ("read_file", {"path": "../secret.txt"}),
                ("read_file", {"path": str(secret)}), ("list_dir", {"path": "linkdir"}),
                ("edit_file", {"path": "link.txt", "old_string": "s3", "new_string": "x"}),
                ("create_file", {"path": "linkdir/planted.txt", "content": "x"}),
                ("delete_file", {"path": "link.txt"}), ("grep", {"pattern": "s3", "path": ".."}),
                ("read_lints", {"paths": ["linkdir"]})]
    for name, args in attempts:
        res = execute(env, name, args)
        assert not res.ok and "outside the workspace" in res.output, (name, res.output)
    assert secret.read_text() == "s3cret" and not (tmp_path / "planted.txt").exists()
    grep = run(env, "grep", pattern="s3cret")  # ripgrep does not follow the links either
    assert grep.output == "no matches for 's3cret'"


def test_root_path_without_leading_slash_is_understood(env) -> None:
    mangled = str(env.root).lstrip("/") + "/pkg/calc.py"  # what 1.5B models tend to write
    assert run(env, "read_file", path=mangled).output.startswith("pkg/calc.py (lines 1-6")


def test_git_directory_is_not_writable_by_tools(env) -> None:
    (env.root / ".git").mkdir(exist_ok=True)  # a pooled sandbox is a git checkout already
    res = run(env, "create_file", path=".git/hooks/pre-commit", content="evil")
    assert not res.ok and "inside .git" in res.output
    assert not (env.root / ".git/hooks/pre-commit").exists()


def test_edit_file_exact_unique_replacement(env) -> None:
    res = run(env, "edit_file", path="pkg/calc.py", old_string="return a - b",
              new_string="return a + b")
    assert res.ok and res.output.startswith("edited pkg/calc.py (+1 -1 lines)")
    assert "-    return a - b\n+    return a + b" in res.data["diff"]
    missing = run(env, "edit_file", path="pkg/calc.py", old_string="return a / b",
                  new_string="x")
    assert not missing.ok and "not found" in missing.output
    spaced = run(env, "edit_file", path="pkg/calc.py", old_string="return  a * b",
                 new_string="x")
    assert "whitespace" in spaced.output
    twice = run(env, "edit_file", path="pkg/calc.py", old_string="(a, b)", new_string="(x, y)")
    assert not twice.ok and "occurs 2 times" in twice.output
    both = run(env, "edit_file", path="pkg/calc.py", old_string="(a, b)", new_string="(a, c)",
               replace_all=True)
    assert both.ok and (env.root / "pkg/calc.py").read_text().count("(a, c)") == 2
    broken = run(env, "edit_file", path="pkg/calc.py", old_string="def mul(a, c):",
                 new_string="def mul(a, c)")
    assert broken.ok and "syntax errors" in broken.output


def test_edit_file_names_the_read_file_that_has_old_string(env) -> None:
    (env.root / "tests").mkdir()
    (env.root / "tests" / "test_calc.py").write_text("from pkg.calc import add\n")
    ctx = T.ToolContext()
    for rel in ("pkg/calc.py", "tests/test_calc.py"):
        execute(env, "read_file", {"path": rel}, ctx)
    res = execute(env, "edit_file", {"path": "tests/test_calc.py", "old_string":
                                     "return a - b", "new_string": "return a + b"}, ctx)
    assert not res.ok and res.output.endswith(
        "copy the text exactly (it does occur in pkg/calc.py: edit that file)")


def test_edit_file_tolerates_switched_quotes_only_when_unique(env) -> None:
    path = env.root / "pkg" / "greet.py"
    path.write_text('NAME = "world"\nGREETING = "hello"\nOTHER = "hello"\n')
    res = run(env, "edit_file", path="pkg/greet.py", old_string="NAME = 'world'",
              new_string="NAME = 'there'")
    assert res.ok and path.read_text().startswith("NAME = 'there'\nGREETING")
    twice = run(env, "edit_file", path="pkg/greet.py", old_string="= 'hello'", new_string="x")
    assert not twice.ok and "not found" in twice.output
    assert path.read_text().count('"hello"') == 2


def test_sketch_edits_the_merge_declines_say_what_to_do(env) -> None:
    """Without an engine (the default services) a sketch the deterministic merge declines is
    refused with its reasons and the way out."""
    before = (env.root / "pkg/calc.py").read_text()
    res = run(env, "edit_file", path="pkg/calc.py", code_edit="# ... existing code ...\n")
    assert not res.ok and "old_string/new_string" in res.output
    assert "could not apply code_edit" in res.output
    assert (env.root / "pkg/calc.py").read_text() == before


def test_create_and_delete(env) -> None:
    res = run(env, "create_file", path="docs/new/notes.md", content="hello\n")
    assert res.ok and res.output == "created docs/new/notes.md (+1 -0 lines)"
    assert (env.root / "docs/new/notes.md").read_text() == "hello\n"
    assert run(env, "create_file", path="docs/new/notes.md", content="x").output.startswith(
        "overwrote")
    assert run(env, "delete_file", path="docs/new/notes.md").ok
    assert not (env.root / "docs/new/notes.md").exists()
    assert "directory" in run(env, "delete_file", path="docs").output


def test_grep_ripgrep_and_python_fallback_agree(env, monkeypatch) -> None:
    fast = run(env, "grep", pattern=r"def \w+\(a", include="*.py")
    assert fast.data["engine"] == "rg"
    assert fast.output.splitlines() == ["pkg/calc.py:1:def add(a, b):",
                                        "pkg/calc.py:5:def mul(a, b):"]
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda n: None if n == "rg" else real_which(n))
    slow = run(env, "grep", pattern=r"def \w+\(a", include="*.py")
    assert slow.data["engine"] == "python" and slow.output == fast.output
    assert run(env, "grep", pattern="ADD", case_sensitive=False).data["count"] == 2
    assert "invalid regular expression" in run(env, "grep", pattern="(").output


@pytest.mark.parametrize("engine", ["rg", "python"])
def test_grep_code_pasted_as_pattern_matches_literally(env, monkeypatch, engine) -> None:
    if engine == "python":
        real_which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda n: None if n == "rg" else real_which(n))
    res = run(env, "grep", pattern="add(a, b)")  # a regex group: matches "adda, b" only
    assert res.output == ("[no regex matches; matched as a literal string]\n"
                          "pkg/calc.py:1:def add(a, b):")
    assert run(env, "grep", pattern="mul(a,").output.startswith(
        "[invalid regular expression; matched as a literal string]\npkg/calc.py:5:")
    assert run(env, "grep", pattern="zz(").output == \
        "no matches for 'zz(' (invalid regular expression; no literal match either)"
    assert run(env, "grep", pattern="ad+ and").output == "README.md:2:add and mul"  # a regex
    miss = run(env, "grep", pattern="pkg/calc.py")
    assert miss.output == "no matches for 'pkg/calc.py'; pkg/calc.py is a file: read it " \
        "with read_file"
    assert "is a file" not in run(env, "grep", pattern="/etc/passwd").output


def test_file_search_glob_and_fuzzy(env) -> None:
    assert run(env, "file_search", query="*.py").output.splitlines() == [
        "pkg/__init__.py", "pkg/calc.py"]
    assert run(env, "file_search", query="clc").output.splitlines()[0] == "pkg/calc.py"
    assert run(env, "file_search", query="zzz").output == "no files match 'zzz'"


def test_list_dir(env) -> None:
    listed = run(env, "list_dir").output.splitlines()
    assert [ln for ln in listed if ln != ".git/"] == [  # a pooled sandbox is a git checkout
        ".:", "pkg/", "README.md (19 bytes)", "web.js (28 bytes)"]


def test_read_lints_ruff_and_tree_sitter(env) -> None:
    assert run(env, "read_lints").output == "no lint errors in 4 file(s)"
    (env.root / "pkg" / "bad.py").write_text("import os\n\nprint(undefined_name)\n")
    (env.root / "broken.ts").write_text("function f( {\n")
    out = run(env, "read_lints").output.splitlines()
    assert "pkg/bad.py:1:8: F401 `os` imported but unused" in out
    assert any(line.startswith("pkg/bad.py:3:7: F821") for line in out)
    assert any(line.startswith("broken.ts:1:") and "syntax error" in line for line in out)


def test_lints_and_grep_without_sandbox_run_the_same_programs(env) -> None:
    """--no-sandbox runs the same absolute rg and ruff binaries on the host."""
    host = local_environment(env.root, sandbox=False)
    (env.root / "pkg" / "bad.py").write_text("import os\n")
    assert "pkg/bad.py:1:8: F401 `os` imported but unused" in run(host, "read_lints").output
    assert run(host, "grep", pattern="def mul").output == "pkg/calc.py:5:def mul(a, b):"
    bad = run(env, "grep", pattern="(unclosed", case_sensitive=True)
    assert "invalid regular expression" in bad.output or "no matches" in bad.output


def test_run_terminal_cmd_runs_in_the_workspace(env) -> None:
    res = run(env, "run_terminal_cmd", command="python -c 'import pkg.calc; print(1)'; exit 3")
    assert res.output.splitlines() == ["$ python -c 'import pkg.calc; print(1)'; exit 3", "1",
                                       "[exit code 3]"]
    assert res.data["sandboxed"] is env.workspace.sandboxed and res.data["exit_code"] == 3
    slow = run(env, "run_terminal_cmd", command="sleep 20", timeout=1)
    assert slow.output.endswith("[killed: timeout after 1s]")


def test_todo_write_replaces_and_merges(env) -> None:
    ctx = T.ToolContext()
    execute(env, "todo_write", {"todos": [{"id": "1", "content": "read", "status":
                                           "completed"},
                                          {"id": "2", "content": "fix", "status": "pending"}]},
            ctx)
    res = execute(env, "todo_write", {"todos": [{"id": "2", "status": "in_progress"}],
                                      "merge": True}, ctx)
    assert res.output == "[x] 1. read\n[~] 2. fix"
    bad = execute(env, "todo_write", {"todos": [{"id": "1", "status": "done"}]}, ctx)
    assert not bad.ok and "status must be one of" in bad.output


def test_codebase_search_without_a_search_service_reports_no_index(env) -> None:
    res = run(env, "codebase_search", query="where is addition")
    assert res.ok and res.output.startswith("index unavailable:")


def test_codebase_search_on_an_unindexed_workspace(env, settings) -> None:
    res = execute(env, "codebase_search", {"query": "where is addition"},
                  T.ToolContext(services=tool_services(settings)))
    assert res.ok and res.output.startswith("index unavailable:")
    assert "not indexed" in res.output and "grep" in res.output


def test_argument_errors_are_results_not_crashes(env) -> None:
    assert "unknown tool 'nope'" in execute(env, "nope", {}).output
    assert "not valid JSON" in execute(env, "read_file", "{oops").output
    assert "missing required argument(s): path" in execute(env, "read_file", {}).output
    assert "unexpected argument(s) file" in execute(env, "read_file", {"file": "x"}).output
    quoted = execute(env, "read_file", {"path": "pkg/calc.py", "start_line": "5"})
    assert quoted.ok and "(lines 5-6 of 6)" in quoted.output


def test_conflict_rules(env) -> None:
    def c(a, b):
        return default_toolset().conflicts(env, a, b)
    read_a, read_b = ("read_file", {"path": "pkg/calc.py"}), ("grep", {"pattern": "x"})
    edit_a = ("edit_file", {"path": "pkg/calc.py"})
    edit_other = ("create_file", {"path": "README.md"})
    cmd = ("run_terminal_cmd", {"command": "true"})
    assert not c(read_a, read_b) and not c(edit_a, edit_other)
    assert c(read_a, edit_a) and c(read_b, edit_a)  # grep over . sees the edited file
    assert c(cmd, read_a) and c(edit_other, cmd)
    assert not c(("todo_write", {}), cmd) and c(("todo_write", {}), ("todo_write", {}))


@pytest.fixture
def slow_tools() -> tuple[T.Toolset, list]:
    """The standard tools plus two whose work takes a measurable time, and their log."""
    log: list[tuple[str, float, float]] = []

    def slow(env, args, ctx):
        start = time.monotonic()
        time.sleep(0.3)
        log.append((args["path"], start, time.monotonic()))
        return f"done {args['path']}", {}

    props = {"path": {"type": "string"}}
    return T.Toolset([*default_toolset().tools.values(),
                      T.Tool("slow_read", "", props, ("path",), slow, "read"),
                      T.Tool("slow_write", "", props, ("path",), slow, "write")]), log


def _calls(*pairs):
    return [{"id": f"c{i}", "function": {"name": n, "arguments": json.dumps({"path": p})}}
            for i, (n, p) in enumerate(pairs)]


def test_parallel_calls_run_concurrently_and_keep_call_order(env, slow_tools) -> None:
    toolset, _ = slow_tools
    agent = Agent(HttpChatModel("http://127.0.0.1:9/v1", "unused"), env, toolset=toolset)
    start = time.monotonic()
    results = agent._execute(1, _calls(*[("slow_read", f"f{i}") for i in range(4)]))
    assert time.monotonic() - start < 0.9  # serial would be 1.2 s
    assert [r.output for r in results] == ["done f0", "done f1", "done f2", "done f3"]
    serial = Agent(HttpChatModel("http://127.0.0.1:9/v1", "unused"), env,
                   AgentConfig(parallel=False), toolset=toolset)
    start = time.monotonic()
    serial._execute(1, _calls(*[("slow_read", f"f{i}") for i in range(4)]))
    assert time.monotonic() - start >= 1.2


def test_calls_touching_the_same_file_serialize(env, slow_tools) -> None:
    toolset, log = slow_tools
    agent = Agent(HttpChatModel("http://127.0.0.1:9/v1", "unused"), env, toolset=toolset)
    agent._execute(1, _calls(("slow_write", "a.py"), ("slow_read", "a.py"),
                             ("slow_write", "b.py")))
    spans = {p: [] for p in ("a.py", "b.py")}
    for path, start, end in log:
        spans[path].append((start, end))
    (_, w_end), (r_start, _) = sorted(spans["a.py"])
    assert r_start >= w_end  # the read of a.py waited for the write of a.py
    assert spans["b.py"][0][0] < w_end  # the unrelated write did not wait


def test_tool_command(env) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["tool", "read_file", '{"path": "pkg/calc.py", "end_line": 1}',
                              "--path", str(env.root), "--json", "--backend",
                              env.metadata()["runner"]])
    assert res.exit_code == 0
    body = json.loads(res.output)
    assert body["ok"] and "\ndef add(a, b):\n[lines 2-6 not shown" in body["output"]
    res = runner.invoke(app, ["tool", "read_file", '{"path": "nope.py"}', "--path",
                              str(env.root)])
    assert res.exit_code == 1 and "does not exist" in res.output
    assert runner.invoke(app, ["tool", "read_file", "{bad", "--path", str(env.root)]
                         ).exit_code == 2
    res = runner.invoke(app, ["tool", "frobnicate", "{}", "--path", str(env.root)])
    assert res.exit_code == 2 and "unknown tool" in res.output
    listed = json.loads(runner.invoke(app, ["tool", "--json"]).output)
    assert len(listed) == 11
    res = runner.invoke(app, ["tool", "list_dir", "{}", "--path", str(env.root), "--backend",
                              "nosuch"])
    assert res.exit_code == 2 and "unknown workspace backend 'nosuch'" in res.output
    res = runner.invoke(app, ["tool", "list_dir", "{}", "--path", str(env.root),
                              "--backend", "bwrap", "--no-sandbox"])
    assert res.exit_code == 2 and "cannot be combined" in res.output


def test_tool_results_are_thread_safe_under_load(env) -> None:
    """Many concurrent reads and greps on one environment give the same answers."""
    expected = run(env, "grep", pattern="return").output
    outs: list[str] = []
    threads = [threading.Thread(target=lambda: outs.append(run(env, "grep",
                                                               pattern="return").output))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs == [expected] * 8
