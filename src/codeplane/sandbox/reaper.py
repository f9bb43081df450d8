"""Records on disk of every sandbox a server made, and the reaper that removes what a crashed
server left: processes still working in a sandbox, its mounts, its directory.

A record is written *before* anything is created and deleted *after* everything is gone, so
no sandbox directory or mount exists without one. It names its owner as (pid, start time):
a pid alone could be reused by an unrelated process after a reboot or a long uptime.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from codeplane.core.procs import start_ticks
from codeplane.sandbox import clone

log = logging.getLogger("codeplane.fleet")


@dataclass(frozen=True)
class Owner:
    pid: int
    start: int  # clock ticks since boot (field 22 of /proc/PID/stat)

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), start_ticks(os.getpid()))

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.start


@dataclass(frozen=True)
class Record:
    id: str
    path: str
    owner: Owner

    def write(self, records: Path) -> None:
        tmp = records / f".{self.id}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, records / f"{self.id}.json")

    @classmethod
    def read(cls, path: Path) -> Record | None:
        try:
            data = json.loads(path.read_text())
            return cls(data["id"], data["path"], Owner(**data["owner"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def kill_inside(root: Path) -> int:
    """SIGKILL every process whose working directory or root lies under `root` (a process
    a dead server started in a sandbox, or a git it ran while building one); the count."""
    killed = 0
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for link in ("cwd", "root"):
            try:
                target = os.readlink(entry / link)
            except OSError:
                continue
            if target == prefix or target.startswith(prefix + "/"):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
                break
    return killed


def reap(path: Path) -> int:
    """Remove one sandbox completely: its processes, its mounts, its directory."""
    killed = kill_inside(path)
    clone.teardown(path)
    return killed


def reap_orphans(records: Path, sandboxes: Path) -> dict[str, int]:
    """At startup: every record whose owner is dead, and every sandbox directory with no
    record, is reaped. Records of a live owner (another server on the same home) are left.
    A sandbox that cannot be removed is logged and counted in `failed`, its record kept for
    the next start: one tenant's tree never stops the server from starting."""
    stats = {"sandboxes": 0, "processes": 0, "failed": 0}
    kept: set[str] = set()
    for path in sorted(records.glob("*.json")):
        record = Record.read(path)
        if record is not None and record.owner.alive():
            kept.add(record.id)
            continue
        if record is not None and not _reap_counted(Path(record.path), stats):
            kept.add(record.id)
            continue
        path.unlink(missing_ok=True)
    for tmp in records.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    for directory in sorted(sandboxes.iterdir()):
        if directory.name not in kept:
            _reap_counted(directory, stats)
    return stats


def _reap_counted(path: Path, stats: dict[str, int]) -> bool:
    """Reap one sandbox into the start-up counts; False (logged) if it could not go."""
    try:
        stats["processes"] += reap(path)
    except OSError as exc:
        log.error("could not remove the sandbox %s left by a dead server: %s", path, exc)
        stats["failed"] += 1
        return False
    stats["sandboxes"] += 1
    return True
