"""Escapes from the sandbox, each as it was found: the attack runs for real (real bubblewrap,
real git, real sockets on loopback) and the test asserts the host saw nothing of it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from codeplane.agent.env import local_environment
from codeplane.agent.tools import default_toolset
from codeplane.core.files import read_bytes
from codeplane.indexing.query import SNIPPET_FILE_BYTES, _with_snippets
from codeplane.sandbox import BwrapRunner, Limits

execute = default_toolset().execute  # one call as the agent makes it

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory outside the workspace holding a secret."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text("TOPSECRET-42\n")
    return out


# ---------------------------------------------------------------- nothing runs on the host

@pytest.mark.parametrize("plant", ["ruff.py", "ruff/__main__.py"])
def test_read_lints_runs_no_workspace_code_on_the_host(ws: Path, tmp_path: Path,
                                                       plant: str) -> None:
    marker = tmp_path / "pwned"
    (ws / plant).parent.mkdir(parents=True, exist_ok=True)
    (ws / plant).write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(os.environ))\n")
    if plant.startswith("ruff/"):  # a regular package shadows the installed one
        (ws / "ruff/__init__.py").write_text("")
    (ws / "mod.py").write_text("import os\n")
    res = execute(local_environment(ws), "read_lints", {})
    assert not marker.exists(), "a ruff.py from the workspace ran on the host"
    assert res.ok and "mod.py:1:8: F401" in res.output, res.output


def test_grep_fallback_does_not_follow_symlinks_out(ws: Path, outside: Path,
                                                     monkeypatch) -> None:
    (ws / "link.txt").symlink_to(outside / "secret.txt")
    (ws / "linkdir").symlink_to(outside, target_is_directory=True)
    (ws / "own.txt").write_text("TOPSECRET-42 is the name of a constant\n")
    env = local_environment(ws)
    monkeypatch.setenv("PATH", "/nonexistent")  # no ripgrep: the pure-Python fallback
    res = execute(env, "grep", {"pattern": "TOPSECRET"})
    assert res.data["engine"] == "python"
    assert res.output == "own.txt:1:TOPSECRET-42 is the name of a constant", res.output


def test_grep_with_ripgrep_stays_inside(ws: Path, outside: Path) -> None:
    (ws / "linkdir").symlink_to(outside, target_is_directory=True)
    (ws / "own.txt").write_text("TOPSECRET-42\n")
    res = execute(local_environment(ws), "grep", {"pattern": "TOPSECRET", "path": "."})
    assert res.data["engine"] == "rg" and res.output == "own.txt:1:TOPSECRET-42", res.output


@pytest.mark.parametrize("reader", ["host resolver (codeplane search)", "workspace (agent)"])
def test_snippets_refuse_symlinks_out_fifos_and_huge_files(ws: Path, outside: Path,
                                                           reader: str) -> None:
    (ws / "a.py").write_text("x = 1\ny = 2\n")
    (ws / "link.py").symlink_to(outside / "secret.txt")
    os.mkfifo(ws / "pipe.py")
    with open(ws / "sparse.py", "wb") as f:
        f.truncate(300 << 20)
    ranked = [("link.py", 1, 1, 0.9), ("pipe.py", 1, 1, 0.8), ("sparse.py", 1, 1, 0.7),
              ("a.py", 2, 2, 0.6)]
    env = local_environment(ws)

    def read(rel: str) -> bytes:
        if reader.startswith("host"):
            return read_bytes(ws, Path(rel), SNIPPET_FILE_BYTES)
        return env.workspace.read(ws / rel, SNIPPET_FILE_BYTES)

    out: list = []
    worker = threading.Thread(target=lambda: out.append(_with_snippets(read, ranked, 10)),
                              daemon=True)
    worker.start()
    worker.join(60)  # a hang detector, not a speed goal: the old code blocked forever
    if worker.is_alive():
        with open(ws / "pipe.py", "w"):  # release the blocked reader
            pass
        pytest.fail("reading a FIFO for a snippet blocked")
    assert [(h["path"], h["snippet"]) for h in out[0]] == [("a.py", "y = 2")]


def test_read_file_refuses_fifo_and_devices(ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    (ws / "zero").symlink_to("/dev/zero")
    env = local_environment(ws)
    fifo = execute(env, "read_file", {"path": "pipe"})
    assert not fifo.ok and "not a regular file" in fifo.output
    dev = execute(env, "read_file", {"path": "zero"})
    assert not dev.ok and "outside the workspace" in dev.output


# ---------------------------------------------------------------- resources and /etc

def test_private_tmp_is_bounded(ws: Path) -> None:
    res = BwrapRunner(ws).run("dd if=/dev/zero of=/tmp/fill bs=1M count=96 2>&1; "
                              "du -m /tmp/fill", ws, Limits(tmp_bytes=32 << 20))
    assert "No space left on device" in res.output, res.output
    assert int(res.output.split()[-2]) <= 32


def test_no_other_unbounded_tmpfs(ws: Path) -> None:
    """bwrap builds / and /dev on tmpfs mounts of its own, as large as half the RAM."""
    res = BwrapRunner(ws).run(
        "for p in /x /dev/x /dev/shm/x; do dd if=/dev/zero of=$p bs=1M count=48 "
        "status=none && echo wrote $p; done; echo ok > /dev/null && echo null-ok", ws,
        Limits(tmp_bytes=32 << 20))
    assert "wrote" not in res.output and "null-ok" in res.output, res.output
    assert res.output.count("Read-only file system") == 2
    assert "No space left on device" in res.output


def test_workspace_writes_are_bounded(ws: Path) -> None:
    cmd = ("for i in 1 2 3 4 5 6 7 8; do dd if=/dev/zero of=f$i bs=1M count=64 "
           "status=none; sync; done; echo FINISHED")
    res = BwrapRunner(ws).run(cmd, ws, Limits(disk_bytes=96 << 20, file_bytes=128 << 20))
    assert res.killed == "disk" and "FINISHED" not in res.output, res.output
    assert "disk quota" in res.output


def test_minimal_etc(ws: Path) -> None:
    res = BwrapRunner(ws).run(
        "cat /etc/shadow; ls /etc; id -un; python -c 'import ssl; "
        "print(len(ssl.create_default_context().get_ca_certs(True)) > 0 or "
        "__import__(\"os\").path.isdir(\"/etc/ssl/certs\"))'", ws, Limits())
    listing = res.output.split()
    assert "shadow" not in listing and "gshadow" not in listing and "ssh" not in listing
    assert "No such file or directory" in res.output
    assert "sandbox" in listing and "True" in listing and "passwd" in listing  # its own
    assert "ld.so.cache" in listing and "ssl" in listing


def test_interpreter_visible_from_a_venv_under_tmp(ws: Path) -> None:
    venv = Path(f"/tmp/codeplane-venv-test-{os.getpid()}")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    try:
        script = ("import sys; from pathlib import Path; "
                  "from codeplane.sandbox import BwrapRunner, Limits; "
                  f"r = BwrapRunner(Path({str(ws)!r})).run('python -c \"import sys; "
                  f"print(sys.prefix)\"', Path({str(ws)!r}), Limits()); print(r.output)")
        out = subprocess.run([str(venv / "bin/python"), "-c", script], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": SRC}, check=False)
        assert out.stdout.strip() == str(venv), out.stdout + out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(venv)], check=False)


# ---------------------------------------------------------------- .git

def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=cwd,
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null"})


def _plant(marker: Path) -> str:
    return (f"git init -q && git config core.fsmonitor 'touch {marker}' && "
            f"git config core.pager 'touch {marker}'")


@pytest.mark.parametrize("sub", [".", "deep/er"])
def test_git_created_inside_the_sandbox_runs_nothing_on_the_host(tmp_path: Path,
                                                                sub: str) -> None:
    mono = tmp_path / "mono"
    ws = mono / "service"
    ws.mkdir(parents=True)
    (ws / "a.py").write_text("x = 1\n")
    assert _git(mono, "init", "-q").returncode == 0
    marker = tmp_path / "hook-ran"
    res = BwrapRunner(ws).run(f"mkdir -p {sub} && cd {sub} && {_plant(marker)}", ws, Limits())
    assert not marker.exists(), res.output
    status = _git(ws / sub, "status")
    _git(ws / sub, "log", "-1")
    assert not marker.exists(), "the host's git ran a hook planted by the sandbox"
    assert status.returncode == 0  # the monorepo's own git still works in the folder


@pytest.mark.parametrize("sub", [".", "lib"])
def test_bare_repository_made_inside_the_sandbox_is_not_a_repository_on_the_host(
        ws: Path, tmp_path: Path, sub: str) -> None:
    marker = tmp_path / "hook-ran"
    # a directory git takes for a repository (HEAD, objects/, refs/) that names itself as
    # its own work tree: `git status` there runs its fsmonitor
    res = BwrapRunner(ws).run(f"mkdir -p {sub} && cd {sub} && git init -q --bare . && "
                              "git config core.bare false && git config core.worktree \"$PWD\" "
                              f"&& git config core.fsmonitor 'touch {marker}'", ws, Limits())
    _git(ws / sub, "status")
    assert not marker.exists(), res.output
    assert "renamed aside" in res.output, res.output


def test_git_file_and_its_gitdir_are_read_only(ws: Path, tmp_path: Path) -> None:
    real = ws / ".realgit"
    assert _git(ws, "init", "-q", "--separate-git-dir", str(real)).returncode == 0
    gitfile = (ws / ".git").read_text()
    config = (real / "config").read_text()
    marker = tmp_path / "hook-ran"
    BwrapRunner(ws).run(f"echo 'gitdir: /tmp/evil' > .git; echo x >> .realgit/config; "
                        f"git config core.fsmonitor 'touch {marker}'", ws, Limits())
    assert (ws / ".git").read_text() == gitfile
    assert (real / "config").read_text() == config
    _git(ws, "status")
    assert not marker.exists()


def test_nested_repositories_are_read_only(ws: Path, tmp_path: Path) -> None:
    nested = ws / "vendor" / "lib"
    nested.mkdir(parents=True)
    assert _git(nested, "init", "-q").returncode == 0
    marker = tmp_path / "hook-ran"
    res = BwrapRunner(ws).run(f"cd vendor/lib && git config core.fsmonitor 'touch {marker}';"
                              " echo ok > ../../made.txt", ws, Limits())
    assert (ws / "made.txt").exists(), res.output
    _git(nested, "status")
    assert not marker.exists()


# ---------------------------------------------------------------- network

def test_network_cannot_reach_host_loopback(ws: Path, loopback_listener) -> None:
    port = loopback_listener.port
    box = BwrapRunner(ws)
    for host in ("127.0.0.1", "10.0.2.2"):
        res = box.run(f"python -c \"import socket; socket.create_connection(('{host}', {port}),"
                      " 3); print('CONNECTED')\"", ws, Limits(timeout=20, network=True))
        assert "CONNECTED" not in res.output, (host, res.output)
    assert loopback_listener.accepted == []
    # network on is real: the sandbox has a routed interface (without it: unreachable). Only
    # loopback may be the target of a test, so no host interface address is dialled here.
    route = box.run("python -c \"import socket; s = socket.socket(socket.AF_INET, "
                    "socket.SOCK_DGRAM); s.connect(('10.0.2.2', 9)); print(s.getsockname()[0])\"",
                    ws, Limits(timeout=20, network=True))
    assert route.output.strip() == "10.0.2.100", route.output
