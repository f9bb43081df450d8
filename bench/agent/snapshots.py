"""Third-party projects some agent tasks work on, fetched when a run needs them, never committed.

A task names its project in task.json (`"snapshot": "click-8.1.7"`) instead of shipping a
`repo/`. The first run downloads the PyPI sdist with pip (hash-checked: pip refuses a file
whose sha256 differs), unpacks the listed members with tarfile's `data` filter (no links out,
no absolute paths) and keeps the tree under CACHE for every later run.

    python bench/agent/snapshots.py            # fetch them all now (e.g. before going offline)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("/tmp/codeplane-agent-bench/snapshots")


@dataclass(frozen=True)
class Sdist:
    """A PyPI source distribution and the members of it a task's workspace holds."""

    requirement: str  # name==version
    sha256: str  # of the sdist file, as PyPI publishes it
    members: tuple[str, ...]  # paths under the sdist's top folder (a folder: all of it)


SNAPSHOTS = {
    # the library's source, metadata and docs files; its own tests, docs and examples stay out
    # (the tasks bring the tests that judge them)
    "click-8.1.7": Sdist("click==8.1.7",
                         "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de",
                         ("CHANGES.rst", "LICENSE.rst", "README.rst", "setup.cfg", "setup.py",
                          "src/click")),
}


class SnapshotError(Exception):
    """A snapshot cannot be had: unknown, or the download failed (offline?)."""


def snapshot(name: str) -> Path:
    """The unpacked tree of `name`, fetched into CACHE on first use."""
    if name not in SNAPSHOTS:
        raise SnapshotError(f"unknown snapshot {name!r} (known: {', '.join(SNAPSHOTS)})")
    tree = CACHE / name
    if not tree.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            staging = Path(tmp) / name
            _unpack(_download(SNAPSHOTS[name], Path(tmp)), staging, SNAPSHOTS[name].members)
            shutil.rmtree(tree, ignore_errors=True)  # a concurrent fetch may have won
            staging.replace(tree)
    return tree


def _download(sdist: Sdist, into: Path) -> Path:
    """The sdist file, through pip's hash-checking mode."""
    requirements = into / "requirements.txt"
    requirements.write_text(f"{sdist.requirement} --hash=sha256:{sdist.sha256}\n")
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                          "--no-binary", ":all:", "--disable-pip-version-check",
                          "-r", str(requirements), "-d", str(into / "dist")],
                         capture_output=True, text=True, check=False)
    files = list((into / "dist").glob("*.tar.gz")) if got.returncode == 0 else []
    if len(files) != 1:
        why = (got.stderr.strip().splitlines() or ["no sdist came back"])[-1]
        raise SnapshotError(f"cannot fetch {sdist.requirement} from PyPI ({why}); the agent "
                            f"tasks on it need it once, then it is kept in {CACHE}: run again "
                            "with network access")
    return files[0]


def _unpack(archive: Path, dest: Path, members: tuple[str, ...]) -> None:
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        wanted = [m for m in tar.getmembers()
                  if any(m.name == f"{top}/{p}" or m.name.startswith(f"{top}/{p}/")
                         for p in members)]
        tar.extractall(dest.parent / "unpacked", members=wanted, filter="data")
    (dest.parent / "unpacked" / top).rename(dest)


def main() -> int:
    parser = argparse.ArgumentParser(description="Fetch every third-party snapshot the agent "
                                     f"tasks use into {CACHE} (runs do it on first use).")
    parser.parse_args()
    try:
        for name in SNAPSHOTS:
            print(f"{name}: {snapshot(name)}")
    except SnapshotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
