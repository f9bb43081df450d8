"""The Workspace interface on every backend in the table: files confined to the workspace,
commands, snapshots and diffs; the table itself; and every tool reaching files only through
the workspace (a backend whose root does not exist on the host still runs them all)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from codeplane.agent.env import ToolError, local_environment
from codeplane.agent.tools import default_toolset
from codeplane.core.files import Refused, TooLarge
from codeplane.sandbox import BACKENDS, Limits, UnknownBackend, open_workspace
from codeplane.sandbox.backends import HostBackend, NoSettings, Row
from codeplane.sandbox.runner import CommandResult, HostRunner
from codeplane.sandbox.workspace import Entry, FileStat, LocalWorkspace, Snapshot

execute = default_toolset().execute  # one call as the agent makes it


@pytest.fixture(params=list(BACKENDS))
def ws(request, tmp_path: Path, open_backend):
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "secret.txt").write_text("s3cret")
    (root / "out").symlink_to(tmp_path / "secret.txt")
    return open_backend(request.param, root)


def test_files_read_write_stat_list_remove(ws) -> None:
    assert ws.read(Path("pkg/a.py"), 100) == b"x = 1\n"
    ws.write(Path("new/dir/b.txt"), b"hello\n")
    assert (ws.root / "new/dir/b.txt").read_bytes() == b"hello\n"
    assert ws.stat(Path("new/dir/b.txt")) == FileStat("file", 6)
    assert ws.stat(Path("new")) == FileStat("dir") and ws.stat(ws.root) == FileStat("dir")
    assert ws.stat(Path("nope")) is None
    assert ws.stat(Path("out")).kind == "symlink"
    assert [e.name for e in ws.list(ws.root) if e.name != ".git"] == ["new", "out", "pkg"]
    assert ws.list(Path("pkg")) == [Entry("a.py", FileStat("file", 6))]
    ws.remove(ws.root / "new/dir/b.txt")
    assert ws.stat(Path("new/dir/b.txt")) is None
    with pytest.raises(TooLarge):
        ws.read(Path("pkg/a.py"), 3)


def test_files_cannot_leave_the_workspace(ws, tmp_path: Path) -> None:
    for attempt in (lambda: ws.read(Path("out"), 100), lambda: ws.read(Path("../secret.txt"), 9),
                    lambda: ws.write(Path("out"), b"x"), lambda: ws.list(Path("..")),
                    lambda: ws.real(Path("out")), lambda: ws.stat(Path("../x/y")),
                    lambda: ws.remove(Path("../secret.txt"))):
        with pytest.raises(Refused):
            attempt()
    os.mkfifo(ws.root / "pipe")
    with pytest.raises(Refused, match="FIFO"):
        ws.read(Path("pipe"), 100)  # refused, not blocked on
    assert (tmp_path / "secret.txt").read_text() == "s3cret"


def test_exec_shell_writes_and_trusted_programs_read(ws) -> None:
    res = ws.exec("echo made > made.txt; cat pkg/a.py", Limits(timeout=30))
    assert res.exit_code == 0 and res.output == "x = 1\n"
    assert ws.read(Path("made.txt"), 100) == b"made\n"
    listed = ws.exec(["/bin/ls", "pkg"], Limits(timeout=30))
    assert listed.output == "a.py\n" and listed.sandboxed is ws.sandboxed
    cancel = threading.Event()
    cancel.set()
    assert ws.exec("sleep 30", Limits(timeout=30), cancel).killed == "cancelled"


def test_trusted_programs_cannot_write_in_the_sandbox(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    ws = open_workspace(root, "bwrap")
    res = ws.exec(["/usr/bin/touch", "planted"], Limits(timeout=30))
    assert res.exit_code != 0 and not (root / "planted").exists()


def test_snapshot_and_diff(ws) -> None:
    (ws.root / ".git").mkdir(exist_ok=True)  # a pooled sandbox is a git checkout already
    (ws.root / "blob.bin").write_bytes(b"\0\1")
    before = ws.snapshot()
    assert set(before.hashes) == {"pkg/a.py", "out", "blob.bin"}  # .git is git's business
    assert ws.diff(before) == ""
    ws.write(Path("pkg/a.py"), b"x = 2\n")
    ws.write(Path("added.txt"), b"new")
    ws.remove(Path("blob.bin"))
    (ws.root / ".git" / "HEAD").write_text("ref: x\n")
    assert ws.diff(before) == (
        "--- /dev/null\n+++ b/added.txt\n@@ -0,0 +1 @@\n+new\n\\ No newline at end of file\n"
        "Binary files a/blob.bin and b/blob.bin differ\n"
        "--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")


def test_backends_come_from_the_table(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(UnknownBackend, match="available: bwrap, host"):
        open_workspace(tmp_path, "nosuch")
    with pytest.raises(ToolError, match="unknown workspace backend"):
        local_environment(tmp_path, backend="nosuch")
    assert open_workspace(tmp_path).sandboxed  # bwrap is the default
    assert not open_workspace(tmp_path, "host").sandboxed
    made: list[Path] = []

    class Extra(HostBackend):
        def open(self, root: Path, network: bool) -> LocalWorkspace:
            made.append(root)
            return LocalWorkspace(root, HostRunner(root))

    monkeypatch.setitem(BACKENDS, "extra", Row(Extra, NoSettings))  # one row is all it needs
    env = local_environment(tmp_path, backend="extra")
    assert made == [tmp_path] and execute(env, "list_dir", {}).ok


class Elsewhere:
    """A backend whose files live somewhere other than where the tools see them: `root`
    does not exist on this machine, so a tool that touched the host's filesystem by that
    path (Path.exists, open, os.walk) would fail. Commands run on the host in the real
    directory, as a remote backend runs them in its own."""

    def __init__(self, real_root: Path) -> None:
        self.inner = LocalWorkspace(real_root, HostRunner(real_root))
        self.root = Path("/nonexistent-codeplane-workspace")
        self.sandboxed = False
        self.calls: set[str] = set()

    def _in(self, path: Path) -> Path:
        full = path if path.is_absolute() else self.root / path
        return self.inner.root / os.path.relpath(full, self.root)

    def _out(self, path: Path) -> Path:
        return self.root / os.path.relpath(path, self.inner.root)

    def real(self, path: Path) -> Path:
        return self._out(self.inner.real(self._in(path)))

    def read(self, path: Path, max_bytes: int) -> bytes:
        self.calls.add("read")
        return self.inner.read(self._in(path), max_bytes)

    def write(self, path: Path, data: bytes) -> None:
        self.calls.add("write")
        self.inner.write(self._in(path), data)

    def remove(self, path: Path) -> None:
        self.calls.add("remove")
        self.inner.remove(self._in(path))

    def stat(self, path: Path) -> FileStat | None:
        self.calls.add("stat")
        return self.inner.stat(self._in(path))

    def list(self, path: Path) -> list[Entry]:
        self.calls.add("list")
        return self.inner.list(self._in(path))

    def exec(self, command: str | list[str], limits: Limits,
             cancel: threading.Event | None = None, stderr: bool = True) -> CommandResult:
        self.calls.add("exec")
        return self.inner.exec(command, limits, cancel, stderr)

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def diff(self, since: Snapshot) -> str:
        return self.inner.diff(since)

    def describe(self) -> dict[str, Any]:
        return {"root": str(self.root), "sandboxed": False, "runner": "elsewhere"}

    def close(self) -> None:
        self.inner.close()


class ElsewhereBackend(HostBackend):
    def open(self, root: Path, network: bool) -> Elsewhere:
        return Elsewhere(root)


@pytest.mark.parametrize("rg", [True, False])
def test_every_tool_goes_through_the_workspace(tmp_path: Path, monkeypatch, rg: bool) -> None:
    real = tmp_path / "real"
    (real / "pkg").mkdir(parents=True)
    (real / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (real / "web.ts").write_text("function f( {\n")
    if not rg:  # the Python fallbacks of grep and list_files
        real_which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda n: None if n == "rg" else real_which(n))
    monkeypatch.setitem(BACKENDS, "elsewhere", Row(ElsewhereBackend, NoSettings))
    env = local_environment(real, backend="elsewhere")
    ws = env.workspace
    assert env.root == ws.root and not ws.root.exists()

    def ok(name: str, **args: Any) -> str:
        res = execute(env, name, args)
        assert res.ok, (name, res.output)
        return res.output

    assert ok("read_file", path="pkg/calc.py").endswith("return a - b")
    assert ok("list_dir", path="pkg") == "pkg:\ncalc.py (32 bytes)"
    assert ok("file_search", query="calc") == "pkg/calc.py"
    assert ok("grep", pattern="return") == "pkg/calc.py:2:    return a - b"
    assert "web.ts:1:" in ok("read_lints", paths=["web.ts"])
    ok("edit_file", path="pkg/calc.py", old_string="a - b", new_string="a + b")
    ok("create_file", path="docs/n.md", content="hi\n")
    ok("delete_file", path="docs/n.md")
    assert ok("run_terminal_cmd", command="cat pkg/calc.py").splitlines()[2] == \
        "    return a + b"
    assert (real / "pkg/calc.py").read_text().endswith("a + b\n")
    assert not (real / "docs/n.md").exists()
    assert ws.calls >= {"read", "write", "remove", "stat", "list", "exec"}


def test_backend_settings_are_validated_by_their_row() -> None:
    from pydantic import ValidationError

    from codeplane.sandbox import Backends
    from codeplane.sandbox.microvm import MicroVMSettings

    built = Backends(settings={"microvm": {"accel": "tcg", "cpus": 2}})
    assert built.settings["microvm"] == MicroVMSettings(accel="tcg", cpus=2)
    assert built.for_caller("t").settings == built.settings
    with pytest.raises(ValidationError, match="accel"):
        Backends(settings={"microvm": {"accel": "hvf"}})
    with pytest.raises(ValidationError, match="extra"):
        Backends(settings={"bwrap": {"cpus": 2}})  # bwrap has no settings
    with pytest.raises(UnknownBackend, match="available: bwrap, host"):
        Backends(settings={"nosuch": {}})
