"""The host-side end of one command in a codeplane microVM, as a process of its own.

`MicroVMWorkspace.exec` runs this under the same supervisor as bubblewrap commands
(`runner.supervise`), so timeouts, the output cap, cancellation and the disk watchdog are
the very same code: killing this process is how a command is stopped, and the workspace
then tells the guest to kill what it started. argv: the fd of a connected port (inherited)
and the request (JSON). Output goes to stdout; the exit code is the command's.
Standard library only, started with `python -I -S`: it runs once per command.
"""

import json
import os
import socket
import sys

MAX_FRAME = 1 << 20  # the agent sends at most 64 KiB a frame: anything larger is garbage

def main() -> int:
    port = socket.socket(fileno=int(sys.argv[1]))
    port.sendall(sys.argv[2].encode() + b"\n")
    while True:
        head = read_exact(port, 5)
        if head is None:
            break
        size = int.from_bytes(head[1:], "big")
        payload = read_exact(port, size) if size <= MAX_FRAME else None
        if payload is None:
            break
        if head[:1] == b"o":
            write_all(payload)
        elif head[:1] == b"x":
            return json.loads(payload)["code"]
    write_all(b"\n[codeplane: the microVM's exec agent went away or broke the protocol]\n")
    return 125


def read_exact(port: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = port.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def write_all(data: bytes) -> None:
    while data:
        data = data[os.write(1, data):]


if __name__ == "__main__":
    sys.exit(main())
