"""When a process started, from /proc: a pid alone names a different process once it is reused,
so owners of sandboxes (the reaper) and of database leases (replicas) are (pid, start time)."""

from __future__ import annotations

import os
from pathlib import Path


def start_ticks(pid: int) -> int:
    """Clock ticks since boot at which `pid` started; -1 if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])  # after "pid (comm)", field 22 is 20th


def started_at(pid: int) -> float | None:
    """Wall-clock time at which `pid` started; None if it is gone or /proc cannot say."""
    ticks = start_ticks(pid)
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text()
                    .splitlines() if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return None if ticks < 0 else boot + ticks / os.sysconf("SC_CLK_TCK")
