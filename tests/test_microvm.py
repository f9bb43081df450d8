"""The microvm backend on a real QEMU guest: commands run under the guest's kernel, files stay
on the host, and the guest reaches nothing of the host but its workspace (read-write) and
the toolchain (read-only).

Under KVM when it can run Debian's kernel here; otherwise under QEMU's TCG emulator, asked
for explicitly (the backend itself refuses to run without KVM). The table's own tool and
workspace tests run on `microvm` only with usable KVM (see `conftest.py`); the tools are run
here on the emulated guest instead. One VM serves the module: a boot under TCG takes
seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from codeplane.agent.env import Environment
from codeplane.agent.tools import default_toolset
from codeplane.sandbox import BACKENDS, Backends, Limits, open_workspace
from codeplane.sandbox.microvm import (
    GuestImage,
    MicroVMSettings,
    MicroVMUnavailable,
    MicroVMWorkspace,
    Share,
    guest_image,
    kvm_problem,
    qemu_argv,
    reap_orphans,
    unavailable,
)

execute = default_toolset().execute  # one call as the agent makes it

ACCEL = "tcg" if kvm_problem() else "kvm"
SMALL = Limits(memory_bytes=512 << 20, tmp_bytes=64 << 20, timeout=60)


@pytest.fixture(scope="module")
def image():
    try:
        return guest_image()
    except MicroVMUnavailable as exc:
        pytest.skip(f"no microVM guest can be built here: {exc}")


@pytest.fixture(scope="module")
def vm(image, tmp_path_factory) -> MicroVMWorkspace:
    root = tmp_path_factory.mktemp("vm") / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    vms = Backends(settings={"microvm": MicroVMSettings(
        accel=ACCEL, memory_bytes=SMALL.memory_bytes, tmp_bytes=SMALL.tmp_bytes)})
    ws = vms.open(root, "microvm")  # through the table, built with its typed settings
    yield ws
    ws.close()


def sh(vm: MicroVMWorkspace, command: str) -> str:
    res = vm.exec(command, SMALL)
    assert res.sandboxed
    return res.output


def test_commands_run_in_the_guest_on_the_hosts_files(vm: MicroVMWorkspace) -> None:
    (vm.root / "from-host.txt").write_text("host wrote this\n")
    res = vm.exec("uname -r; cat from-host.txt; pwd; python -c 'print(6*7)'; "
                  "echo guest > from-guest.txt", SMALL)
    assert res.exit_code == 0, res.output
    lines = res.output.split()  # the guest runs the kernel package's kernel, not the host's
    assert lines[0] != os.uname().release and Path(f"/lib/modules/{lines[0]}").is_dir()
    assert lines[1:] == ["host", "wrote", "this", str(vm.root), "42"]
    assert (vm.root / "from-guest.txt").read_text() == "guest\n"
    assert vm.describe()["runner"] == "microvm"


def test_guest_cannot_read_the_hosts_files(vm: MicroVMWorkspace, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-outside-the-workspace")
    out = sh(vm, f"cat /etc/shadow; cat {secret}; ls /root /home; ls {tmp_path}; "
                 f"ln -s {secret} leak; cat leak; rm leak; mknod disk b 8 0; ls -l disk")
    assert "s3cret" not in out and "No such file" in out
    assert not (vm.root / "disk").exists()  # no device node on the host's disk
    shadow = Path("/etc/shadow")
    if shadow.exists():
        assert shadow.read_text().splitlines()[0] not in out


def test_guest_cannot_reach_the_hosts_loopback(vm: MicroVMWorkspace, loopback_listener) -> None:
    out = sh(vm, "python -c \"import socket; socket.create_connection(('127.0.0.1', "
                 f"{loopback_listener.port}), 5); print('CONNECTED')\"")
    assert "CONNECTED" not in out and "ConnectionRefused" in out
    devices = sh(vm, "tail -n +3 /proc/net/dev | cut -d: -f1").split()
    assert devices == ["lo"]  # no network device at all
    assert loopback_listener.accepted == []
    with pytest.raises(MicroVMUnavailable, match="no network device"):
        MicroVMWorkspace(vm.root, accel=ACCEL, limits=Limits(network=True))
    with pytest.raises(MicroVMUnavailable, match="no network device"):
        vm.exec("true", replace(SMALL, network=True))


def test_toolchain_and_git_metadata_are_read_only(vm: MicroVMWorkspace) -> None:
    prefix = os.path.realpath(sys.prefix)
    out = sh(vm, f"touch /usr/codeplane-probe {prefix}/codeplane-probe; "
                 "mount -o remount,rw /usr; touch /usr/codeplane-probe; "
                 "echo '[core] fsmonitor = id' >> .git/config; "
                 "umount .git; echo '[core] fsmonitor = id' >> .git/config")
    assert not Path("/usr/codeplane-probe").exists()
    assert not Path(prefix, "codeplane-probe").exists()
    assert (vm.root / ".git" / "config").read_text() == "[core]\n", out
    assert "Read-only file system" in out and "permission denied" in out.lower()
    out = sh(vm, "git init -q nested && git -C nested config core.fsmonitor id")
    assert not (vm.root / "nested" / ".git").exists() and "renamed aside" in out


def test_timeout_cancel_and_output_cap_kill_what_the_command_started(
        vm: MicroVMWorkspace) -> None:
    res = vm.exec("(sleep 300 &) ; sleep 300", replace(SMALL, timeout=3))
    assert res.killed == "timeout" and res.exit_code is None
    cancel = threading.Event()
    threading.Timer(2, cancel.set).start()
    res = vm.exec("sleep 300", SMALL, cancel)
    assert res.killed == "cancelled"
    res = vm.exec("head -c 100000 /dev/zero | tr '\\0' x", replace(SMALL, output_bytes=1000))
    assert res.truncated and len(res.output) < 1200 and res.exit_code == 0
    # the port is clean and nothing of the killed commands survived in the guest
    assert "sleep" not in sh(vm, "cat /proc/[0-9]*/comm")


def test_a_command_cannot_speak_for_the_agent(vm: MicroVMWorkspace) -> None:
    """The agent's ports are hidden from commands: a forged exit frame would otherwise
    report success for this command (or for another one running at the same time)."""
    forged = "printf 'x\\0\\0\\0\\013{\"code\": 0}'"
    huge = "printf 'o\\377\\377\\377\\377'"
    res = vm.exec(f"ls /dev/vport*; for p in /dev/vport*; do {forged} > $p; {huge} > $p; "
                  "cat $p; done; exit 3", SMALL)
    assert "vport" in res.output and res.exit_code == 3, res.output
    res = vm.exec("echo alive", SMALL)
    assert res.output.strip() == "alive" and res.exit_code == 0


def test_commands_run_concurrently_and_limits_hold(vm: MicroVMWorkspace) -> None:
    results: list[str] = []
    threads = [threading.Thread(target=lambda n=n: results.append(sh(vm, f"echo run{n}")))
               for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.strip() for r in results) == ["run0", "run1", "run2"]
    bomb = vm.exec("for i in $(seq 200); do sleep 30 & done; wait", replace(SMALL, processes=20,
                                                                       timeout=20))
    assert "fork" in bomb.output.lower() or "resource" in bomb.output.lower(), bomb.output


def test_agent_tools_run_unchanged_on_the_guest(vm: MicroVMWorkspace) -> None:
    env = Environment(vm, SMALL)
    assert "return a - b" in execute(env, "grep", {"pattern": "a - b"}).output
    assert "calc.py" in execute(env, "file_search", {"query": "calc"}).output
    assert execute(env, "edit_file", {"path": "pkg/calc.py", "old_string": "a - b",
                                      "new_string": "a + b"}).ok
    res = execute(env, "run_terminal_cmd", {"command": "python -c 'import pkg.calc as c; "
                                                       "print(c.add(2, 3))'"})
    assert res.ok and "5" in res.output
    snap = vm.snapshot()
    vm.write(Path("pkg/new.py"), b"x = 1\n")
    assert "+x = 1" in vm.diff(snap)


def test_close_kills_the_vm(image, tmp_path: Path) -> None:
    ws = MicroVMWorkspace(tmp_path, accel=ACCEL, limits=SMALL, image=image)
    proc, run_dir = ws.vm.proc, ws.vm.run_dir
    ws.close()
    assert proc.poll() is not None and not run_dir.exists()


def test_the_backend_requires_kvm(tmp_path: Path) -> None:
    assert "microvm" in BACKENDS
    if unavailable() is None:
        pytest.skip("KVM is usable here: the table's tests run on microvm")
    with pytest.raises(MicroVMUnavailable, match="not usable|not installed|apt-get"):
        open_workspace(tmp_path, "microvm")


def test_the_vms_of_a_killed_process_are_reaped(image, tmp_path: Path) -> None:
    script = ("import sys, time; from pathlib import Path; "
              "from codeplane.sandbox.microvm import MicroVMWorkspace, guest_image; "
              "from codeplane.sandbox.runner import Limits; "
              f"ws = MicroVMWorkspace(Path({str(tmp_path)!r}), accel={ACCEL!r}, "
              "limits=Limits(memory_bytes=256 << 20, tmp_bytes=16 << 20), image=guest_image()); "
              "print(ws.vm.proc.pid, ws.vm.run_dir, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid, run_dir = owner.stdout.readline().split()
    owner.kill()  # SIGKILL: no finalizer runs, QEMU (its own session) lives on
    owner.wait()
    assert Path(f"/proc/{pid}").exists()
    assert reap_orphans() >= 1
    assert not Path(run_dir).exists()
    assert _dead(pid)


def _dead(pid: str) -> bool:
    """Gone, or a zombie left for init to reap (SIGKILL is not instant: look for a while)."""
    for _ in range(300):
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        threading.Event().wait(0.1)
    return False


def test_share_paths_qemu_or_the_kernel_cannot_carry_are_refused(tmp_path: Path) -> None:
    image = GuestImage(tmp_path / "vmlinux", tmp_path / "initrd")
    for path, reason in ((tmp_path / "a,b", "comma"), (tmp_path / ("w" * 1500), "too long")):
        with pytest.raises(MicroVMUnavailable, match=reason):
            qemu_argv("qemu", tmp_path, image, [Share(path, writable=True)], "kvm", 1 << 30,
                       1 << 20, 1)
