"""Walk a workspace the way git would see it, plus codeplane's own exclusions.

Ignore sources, lowest precedence first (the last matching pattern wins, as in git):
built-in defaults (VCS/vendored/generated folders), `.git/info/exclude`, then at every directory
level `.gitignore`, `.cursorignore` and `.codeplaneignore`, deeper levels overriding shallower
ones. Patterns use git's wildmatch semantics via `pathspec.GitIgnoreSpec` (negation, anchoring,
directory-only patterns). As in git, a file inside an excluded directory cannot be re-included:
excluded directories are never entered.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from codeplane.config import IndexingSettings
from codeplane.core.files import Refused, read_bytes

IGNORE_FILES = (".gitignore", ".cursorignore", ".codeplaneignore")
# Files whose purpose is to hold secrets: never read for indexing, whatever they contain. A
# project can re-include one with a negation (`!.env.example`) in its own ignore files.
SECRET_FILES = (
    ".env", ".env.*", "*.env", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks",
    "*.keystore", "*.kdbx", "*.gpg", "*.asc", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
    ".netrc", ".pgpass", ".npmrc", ".pypirc", ".git-credentials", ".htpasswd", "*.tfstate",
    "*.tfstate.*", "*.tfvars", "credentials.json", "service-account*.json", ".aws/",
    ".ssh/", ".gnupg/", ".docker/config.json", "secrets.y*ml", "*.secret", "*.secrets",
)
DEFAULT_IGNORES = (
    ".git/", ".hg/", ".svn/", "node_modules/", "bower_components/", "vendor/", "third_party/",
    "__pycache__/", ".venv/", "venv/", ".tox/", ".nox/", ".mypy_cache/", ".pytest_cache/",
    ".ruff_cache/", "dist/", "build/", "target/", ".next/", ".gradle/", ".idea/", ".eggs/",
    "*.egg-info/", "*.min.js", "*.min.css", "*.map", "*.pyc", "*.lock", "package-lock.json",
    "*.pb.go", "*_pb2.py", "*.generated.*",
    *SECRET_FILES,
)
DEFAULT_MAX_BYTES: int = IndexingSettings.model_fields["max_file_bytes"].default
_NAMED = re.compile(r"\(\?P<\w+>")


@dataclass
class ScanResult:
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # rel -> (mtime_ns, size)
    ignored: int = 0  # files and directories excluded by ignore rules
    too_large: int = 0


class _Level:
    """The ignore patterns of one directory, matched relative to that directory."""

    def __init__(self, base: str, spec: pathspec.GitIgnoreSpec) -> None:
        self.base, self.spec = base, spec
        # pathspec tries each pattern in Python for every path at every level; one combined
        # regex answers "does anything match?" in C, and most paths match nothing.
        self.any = re.compile("|".join(
            f"(?:{_NAMED.sub('(?:', p.regex.pattern)})"
            for p in spec.patterns if p.include is not None and p.regex is not None) or "(?!)")

    def verdict(self, rel: str, is_dir: bool) -> bool | None:
        sub = rel[len(self.base) + 1:] if self.base else rel
        sub = sub + "/" if is_dir else sub
        if not self.any.search(sub):
            return None
        return self.spec.check_file(sub).include


IGNORE_FILE_BYTES = 1 << 20  # an ignore file larger than this is not an ignore file


def _read_spec(root: Path, paths: list[Path]) -> pathspec.GitIgnoreSpec | None:
    """Patterns of the ignore files among `paths`; read through the workspace resolver, so a
    FIFO, device or symlink out of the tree planted as `.gitignore` is skipped, not read."""
    lines: list[str] = []
    for path in paths:
        try:
            data = read_bytes(root, path, IGNORE_FILE_BYTES)
        except (OSError, Refused):
            continue
        lines += data.decode(errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines) if lines else None


def is_ignored(levels: list[_Level], rel: str, is_dir: bool) -> bool:
    result = False
    for level in levels:
        verdict = level.verdict(rel, is_dir)
        if verdict is not None:
            result = verdict
    return result


def scan(root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> ScanResult:
    """Every indexable file under root with its (mtime_ns, size); nothing is read here."""
    root = root.resolve()
    levels = [_Level("", pathspec.GitIgnoreSpec.from_lines(DEFAULT_IGNORES))]
    exclude = _read_spec(root, [root / ".git" / "info" / "exclude"])
    if exclude:
        levels.append(_Level("", exclude))
    result = ScanResult()
    _walk(root, root, "", levels, max_bytes, result)
    return result


def _walk(root: Path, folder: Path, rel: str, levels: list[_Level], max_bytes: int,
          out: ScanResult) -> None:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    names = {e.name for e in entries}
    present = [folder / name for name in IGNORE_FILES if name in names]
    own = _read_spec(root, present) if present else None
    if own:
        levels = [*levels, _Level(rel, own)]
    for entry in entries:
        child = f"{rel}/{entry.name}" if rel else entry.name
        try:
            if entry.is_symlink():
                continue  # a link can point outside the workspace or loop
            is_dir = entry.is_dir()
            if is_ignored(levels, child, is_dir):
                out.ignored += 1
            elif is_dir:
                _walk(root, Path(entry.path), child, levels, max_bytes, out)
            elif entry.is_file():
                stat = entry.stat()
                if stat.st_size > max_bytes:
                    out.too_large += 1
                else:
                    out.files[child] = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            continue


def looks_binary(data: bytes) -> bool:
    """git's heuristic: a NUL byte in the first 8 KB."""
    return b"\0" in data[:8192]
