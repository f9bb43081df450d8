"""The sandbox is not the host's root (#29 C3): a sandboxed command runs as an unprivileged
uid in a user namespace with no capabilities (and cannot make another), cannot write the host's kernel settings
(/proc/sys, /proc/sysrq-trigger) or read its keyrings (/proc/keys), and setuid files grant
nothing. Real bubblewrap; the only write to a kernel setting is the audit's harmless one (the
current value written back), and /proc/sysrq-trigger is only opened, never written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from codeplane.sandbox import BwrapRunner, Limits

SANDBOX_UID = 1000  # the uid commands run as (docs/agent.md, "Sandbox")


def test_commands_run_as_an_unprivileged_uid_without_capabilities(ws: Path) -> None:
    res = BwrapRunner(ws).run("id -u; id -g; id -un; grep -E '^Cap(Eff|Prm|Bnd):' "
                              "/proc/self/status; cat /proc/self/uid_map; echo x > made.txt; "
                              "unshare --user true && echo NESTED-USERNS", ws, Limits())
    lines = [line.split() for line in res.output.splitlines()]
    assert lines[0] == [str(SANDBOX_UID)] and lines[1] == [str(SANDBOX_UID)], res.output
    assert lines[2] == ["sandbox"], res.output
    assert {tuple(cap) for cap in lines[3:6]} == {
        ("CapPrm:", "0" * 16), ("CapEff:", "0" * 16), ("CapBnd:", "0" * 16)}, res.output
    # the sandbox's only uid is the server's own: what it writes belongs to the server
    assert lines[6] == [str(SANDBOX_UID), str(os.geteuid()), "1"], res.output
    assert (ws / "made.txt").stat().st_uid == os.geteuid()
    assert "NESTED-USERNS" not in res.output  # no user namespace of its own inside


def test_host_kernel_settings_and_keys_are_out_of_reach(ws: Path) -> None:
    before = Path("/proc/sys/kernel/core_uses_pid").read_text()
    script = (
        # the audit's write, made harmless: the current value back
        "v=$(cat /proc/sys/kernel/core_uses_pid); "
        "printf %s \"$v\" > /proc/sys/kernel/core_uses_pid && echo WROTE-SYSCTL; "
        # opened for writing only (never written: a byte there would act on the host)
        "python3 -c \"import os; os.close(os.open('/proc/sysrq-trigger', os.O_WRONLY)); "
        "print('OPENED-SYSRQ')\"; "
        "cat /proc/keys /proc/key-users /proc/timer_list; echo end")
    res = BwrapRunner(ws).run(script, ws, Limits())
    assert res.output.rstrip().endswith("end"), res.output
    assert "WROTE-SYSCTL" not in res.output and "OPENED-SYSRQ" not in res.output, res.output
    assert "Read-only file system" in res.output, res.output
    assert "keyring" not in res.output and "Timer List" not in res.output, res.output
    assert Path("/proc/sys/kernel/core_uses_pid").read_text() == before
    readable = BwrapRunner(ws).run("cat /proc/sys/kernel/pid_max", ws, Limits())
    assert readable.output.strip().isdigit(), readable.output  # read-only, not hidden


def test_setuid_files_grant_nothing(ws: Path) -> None:
    """A setuid copy of `id` owned by another host user: run inside, it must not become that
    user (the workspace is mounted nosuid, and that uid does not exist in the namespace)."""
    shutil.copy("/usr/bin/id", ws / "suid-id")
    os.chown(ws / "suid-id", 65534, 65534)
    os.chmod(ws / "suid-id", 0o6755)
    res = BwrapRunner(ws).run("./suid-id -u; cp /usr/bin/id mine && chmod u+s mine && "
                              "./mine -u; cat /proc/self/mountinfo", ws, Limits())
    lines = res.output.splitlines()
    assert lines[:2] == [str(SANDBOX_UID)] * 2, res.output
    writable = {"/tmp", "/dev/shm", str(ws)}
    mounts = [f for f in map(str.split, lines[2:]) if len(f) > 5]  # then the guard's note
    options = {f[4]: f[5].split(",") for f in mounts if f[4] in writable}
    assert set(options) == writable, res.output
    assert all("nosuid" in opts for opts in options.values()), options
    # on the host, the bit the command set is gone (as root it made a setuid-root file)
    assert not os.stat(ws / "mine").st_mode & 0o6000, res.output
