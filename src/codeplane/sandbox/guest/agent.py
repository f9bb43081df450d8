"""The exec agent inside a codeplane microVM: runs the host's commands, one at a time per port.

It runs on the host's own Python (shared read-only into the guest), with only the standard
library, as the one child of the guest's PID 1. The host talks to it over virtio-serial
ports named `codeplane.N` (the host machine's kernel has no vhost-vsock here, and a serial
port needs nothing from it): one request per line of JSON, one frame per answer (a kind
byte, a 4-byte big-endian length, the payload).

  {"op": "run", "id", "argv", "cwd", "env", "stderr", "pids", "memory", "ro"}
      -> "o" frames (output), then "x" {"id", "code"} when everything it started is dead
  {"op": "kill", "id"}
      -> kills that command if it is running; then "k" with b"\\0codeplane-ack-ID\\n"

The host sends `kill` after every command (the normal case: a no-op), so whatever state a
killed host-side reader left the stream in, the host reads up to the ack and the port is
clean for the next command. A port has one opener at a time, the agent, so a command that
opens one to forge frames gets EBUSY. Each command runs in a cgroup of its own (pids.max,
memory.max; `cgroup.kill` ends every process it started), in a mount namespace where the
paths in `ro` (the workspace's git metadata, or the whole workspace for a read-only
program) are bound read-only, without CAP_SYS_ADMIN (so it cannot undo them) or CAP_MKNOD.
"""

import json
import os
import select
import subprocess
import threading
import time
from pathlib import Path

GRACE = 0.5  # seconds to keep reading after the command exits (descendants may hold the pipe)
BUSYBOX = "/bb/busybox"
# join the cgroup in $1, mount each path in $3.. (count $2) onto itself read-only, run the rest
PREPARE = ('echo $$ > "$1" && n=$2 && shift 2 || exit 125; while [ "$n" -gt 0 ]; do '
           f'{BUSYBOX} mount --bind "$1" "$1" && '
           f'{BUSYBOX} mount -o remount,bind,ro "$1" "$1" || exit 125; '
           'shift; n=$((n-1)); done; exec "$@"')
# capabilities a command loses: mounts (the read-only binds), modules and raw I/O (the guest
# kernel), reboot, and mknod (QEMU's 9p server refuses device nodes too: two locks on the
# host's disk)
DROP = "-sys_admin,-sys_module,-sys_rawio,-sys_boot,-mknod"
# util-linux from the host's /usr, by absolute path: busybox's shell prefers its own applets


class Port:
    """One virtio-serial port: a line reader over its fd and a framed writer."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.buf = b""
        self.backlog: list[bytes] = []  # requests read while a command ran

    def lines(self, timeout: float | None) -> list[bytes]:
        """Complete request lines that arrive within `timeout` (None: wait for one).
        A port reads 0 bytes while the host is not connected: wait and look again."""
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return []
            chunk = os.read(self.fd, 65536)
            if not chunk:
                time.sleep(0.01)
                if timeout is not None:
                    return []
                continue
            self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return lines

    def send(self, kind: bytes, payload: bytes) -> None:
        data = kind + len(payload).to_bytes(4, "big") + payload
        while data:
            data = data[os.write(self.fd, data):]


def serve(port: Port) -> None:
    while True:
        lines, port.backlog = port.backlog or port.lines(None), []
        for line in lines:
            request = json.loads(line)
            if request["op"] == "run":
                run(port, request)
            else:
                port.send(b"k", b"\0codeplane-ack-" + request["id"].encode() + b"\n")


def run(port: Port, request: dict) -> None:
    """Run one command, streaming its output, until it and everything it started is dead."""
    cgroup = Path("/sys/fs/cgroup") / f"cmd-{request['id']}"
    cgroup.mkdir()
    (cgroup / "pids.max").write_text(str(request["pids"]))
    (cgroup / "memory.max").write_text(str(request["memory"]))
    argv = ["/usr/bin/unshare", "--mount", "--propagation", "private", "--",
            BUSYBOX, "sh", "-c", PREPARE, "sh", str(cgroup / "cgroup.procs"),
            str(len(request["ro"])), *request["ro"],
            "/usr/bin/setpriv", f"--bounding-set={DROP}", "--", *request["argv"]]
    try:
        proc = subprocess.Popen(argv, cwd=request["cwd"], env=request["env"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if request["stderr"]
                                else subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        port.send(b"o", f"codeplane: cannot start the command: {exc}\n".encode())
        port.send(b"x", json.dumps({"id": request["id"], "code": 127}).encode())
        cgroup.rmdir()
        return
    code = pump(port, proc, cgroup, request["id"])
    port.send(b"x", json.dumps({"id": request["id"], "code": code}).encode())


def pump(port: Port, proc: subprocess.Popen, cgroup: Path, ident: str) -> int:
    out = proc.stdout.fileno()
    exited_at = None
    while True:
        ready, _, _ = select.select([out, port.fd], [], [], 0.05)
        if out in ready:
            chunk = os.read(out, 65536)
            if not chunk:
                break
            port.send(b"o", chunk)
        if port.fd in ready:
            for line in port.lines(0):
                port.backlog.append(line)  # answered once the command is over
                if json.loads(line).get("id") == ident:  # the host gave up on it
                    kill(cgroup)
        if exited_at is None and proc.poll() is not None:
            exited_at = time.monotonic()
        if exited_at is not None and time.monotonic() - exited_at > GRACE:
            kill(cgroup)
    kill(cgroup)
    proc.wait()
    proc.stdout.close()
    remove(cgroup)
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def kill(cgroup: Path) -> None:
    try:
        (cgroup / "cgroup.kill").write_text("1")
    except OSError:
        pass


def remove(cgroup: Path) -> None:
    """The cgroup goes once its last process is reaped (by PID 1, for orphans)."""
    for _ in range(200):
        try:
            cgroup.rmdir()
            return
        except OSError:
            kill(cgroup)
            time.sleep(0.01)


def ports() -> list[str]:
    found = []
    for entry in sorted(Path("/sys/class/virtio-ports").iterdir()):
        if (entry / "name").read_text().strip().startswith("codeplane."):
            found.append(f"/dev/{entry.name}")
    return found


def main() -> None:
    threads = [threading.Thread(target=serve, args=(Port(path),)) for path in ports()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
