"""The CI install is locked (security review 2026-11-28, L7): `requirements/ci.txt`, which
`scripts/test` installs with `--require-hashes`, pins every dependency `pyproject.toml` asks
for (the default install and the dev and rl extras) at a version its specifier allows, with
sha256 hashes. A dependency added to pyproject.toml without `bash scripts/lock` fails here
rather than in CI's install."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def locked() -> dict[str, tuple[str, int]]:
    """name -> (pinned version, number of hashes) from requirements/ci.txt."""
    pins: dict[str, tuple[str, int]] = {}
    text = (ROOT / "requirements" / "ci.txt").read_text()
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==(\S+)", block)
        if head:
            pins[canonicalize_name(head[1])] = (head[2], block.count("--hash=sha256:"))
    return pins


def test_every_dependency_is_pinned_with_hashes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [
        dep for extra in ("dev", "rl") for dep in project["optional-dependencies"][extra]]
    pins = locked()
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements/ci.txt: run bash scripts/lock"
        version, hashes = pins[name]
        assert req.specifier.contains(version, prereleases=True), (req, version)
        assert hashes >= 1, f"{req.name}=={version} has no sha256 hash"
