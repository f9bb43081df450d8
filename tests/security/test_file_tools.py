"""The file tools lose nothing: untouched bytes round-trip in every encoding they accept, what
they cannot round-trip they refuse, writes are atomic, keep the mode and cannot be redirected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from codeplane.agent import toolset as T
from codeplane.agent.env import Environment, local_environment
from codeplane.agent.tools import default_toolset, edit

execute = default_toolset().execute  # one call as the agent makes it

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def env(tmp_path: Path) -> Environment:
    root = tmp_path / "ws"
    root.mkdir()
    return local_environment(root)


def _edit(env: Environment, path: str, old: str, new: str) -> T.ToolResult:
    return execute(env, "edit_file", {"path": path, "old_string": old, "new_string": new})


def test_latin1_untouched_lines_round_trip(env) -> None:
    (env.root / "names.py").write_bytes(b"name = 'Jos\xe9'\nx = 1\n")
    shown = execute(env, "read_file", {"path": "names.py"})
    assert "Jos\xe9" in shown.output and "Latin-1" in shown.output
    res = _edit(env, "names.py", "x = 1", "x = 2")
    assert res.ok, res.output
    assert (env.root / "names.py").read_bytes() == b"name = 'Jos\xe9'\nx = 2\n"
    refused = _edit(env, "names.py", "x = 2", "x = '\u20ac'")  # not encodable in Latin-1
    assert not refused.ok and "Latin-1" in refused.output
    assert (env.root / "names.py").read_bytes() == b"name = 'Jos\xe9'\nx = 2\n"


def test_utf16_with_bom_round_trips(env) -> None:
    for codec in ("utf-16-le", "utf-16-be"):
        bom = b"\xff\xfe" if codec.endswith("le") else b"\xfe\xff"
        path = env.root / f"{codec}.txt"
        path.write_bytes(bom + "a = '\u00e9'\nb = 2\n".encode(codec))
        res = _edit(env, path.name, "b = 2", "b = 3")
        assert res.ok, res.output
        assert path.read_bytes() == bom + "a = '\u00e9'\nb = 3\n".encode(codec)


def test_utf8_bom_and_crlf_are_kept(env) -> None:
    path = env.root / "win.py"
    path.write_bytes(b"\xef\xbb\xbfa = 1\r\nb = 2\r\nc = 3\r\n")
    shown = execute(env, "read_file", {"path": "win.py"})
    assert "\r" not in shown.output and "a = 1\nb = 2" in shown.output
    res = _edit(env, "win.py", "a = 1\nb = 2", "a = 1\nb = 20\nb2 = 21")
    assert res.ok, res.output
    assert path.read_bytes() == b"\xef\xbb\xbfa = 1\r\nb = 20\r\nb2 = 21\r\nc = 3\r\n"
    mixed = env.root / "mixed.txt"
    mixed.write_bytes(b"one\r\ntwo\nthree\r\n")
    assert _edit(env, "mixed.txt", "two", "2").ok
    assert mixed.read_bytes() == b"one\r\n2\nthree\r\n"


def test_invalid_utf8_in_a_utf8_file_is_not_replaced(env) -> None:
    """A UTF-8 file with one stray byte is not silently rewritten with U+FFFD."""
    path = env.root / "mostly.txt"
    original = "caf\u00e9\n".encode() + b"bad \xff byte\nlast\n"
    path.write_bytes(original)
    res = _edit(env, "mostly.txt", "last", "final")
    assert res.ok, res.output
    assert path.read_bytes() == original.replace(b"last", b"final")


def test_binary_and_huge_files_are_refused_before_reading(env) -> None:
    (env.root / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    res = execute(env, "read_file", {"path": "img.png"})
    assert not res.ok and "binary" in res.output
    assert not _edit(env, "img.png", "PNG", "GIF").ok
    with open(env.root / "huge.log", "wb") as f:
        f.truncate(600 << 20)  # sparse: reading it would allocate 600 MB
    res = execute(env, "read_file", {"path": "huge.log"})
    assert not res.ok and "too large" in res.output, res.output
    assert not _edit(env, "huge.log", "a", "b").ok
    assert execute(env, "delete_file", {"path": "huge.log"}).ok  # deleting needs no read
    assert not (env.root / "huge.log").exists()


def test_writes_keep_the_mode(env) -> None:
    path = env.root / "run.sh"
    path.write_text("echo one\n")
    path.chmod(0o751)
    assert _edit(env, "run.sh", "one", "two").ok
    assert path.stat().st_mode & 0o7777 == 0o751 and path.read_text() == "echo two\n"
    assert execute(env, "create_file", {"path": "run.sh", "content": "echo 3\n"}).ok
    assert path.stat().st_mode & 0o7777 == 0o751
    assert not [p for p in env.root.iterdir() if p.name != "run.sh"]  # no temp files left


def test_symlink_swapped_in_between_read_and_write_does_not_escape(env, tmp_path: Path,
                                                                   monkeypatch) -> None:
    pkg = env.root / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text("x = 1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mod.py").write_text("x = 1\n")
    read = edit.read_text

    def read_then_swap(*args, **kwargs):
        """The race, made deterministic: the directory becomes a symlink right after the
        tool has read the file and before it writes."""
        out = read(*args, **kwargs)
        if pkg.is_dir() and not pkg.is_symlink():
            os.rename(pkg, env.root / "pkg.orig")
            pkg.symlink_to(elsewhere, target_is_directory=True)
        return out

    monkeypatch.setattr(edit, "read_text", read_then_swap)
    _edit(env, "pkg/mod.py", "x = 1", "x = 666")
    assert (elsewhere / "mod.py").read_text() == "x = 1\n"


_WRITER = """
import sys
from pathlib import Path
from codeplane.agent.tools import default_toolset
from codeplane.agent.env import local_environment
env = local_environment(Path(sys.argv[1]), sandbox=False)
print("ready", flush=True)
sys.stdin.readline()
default_toolset().execute(env, "create_file", {"path": "big.txt", "content": "N" * (256 << 20)})
"""


def test_kill_during_write_leaves_old_or_new(env) -> None:
    path = env.root / "big.txt"
    old = b"O" * (64 << 20)
    path.write_bytes(old)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(env.root)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": SRC})
    assert proc.stdout.readline().strip() == b"ready"
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    while proc.poll() is None:  # kill as soon as anything on disk starts to change
        names = {p.name for p in env.root.iterdir()}
        if names != {"big.txt"} or path.stat().st_size != len(old):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = path.read_bytes()
    assert data == old or data == b"N" * (256 << 20), f"torn file: {len(data)} bytes"


def test_delete_and_create_stay_inside(env, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (env.root / "ln.txt").symlink_to(victim)
    res = execute(env, "delete_file", {"path": "ln.txt"})
    assert not res.ok and victim.exists()
    made = execute(env, "create_file", {"path": "new/dir/a.txt", "content": "hi\n"})
    assert made.ok and (env.root / "new/dir/a.txt").read_text() == "hi\n"
    fifo = env.root / "p"
    os.mkfifo(fifo)
    assert not execute(env, "create_file", {"path": "p", "content": "x"}).ok
