"""Checking code: read_lints (ruff inside the sandbox for Python, tree-sitter syntax errors for
other languages)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.tools.common import list_files, shown_text, syntax_errors
from codeplane.agent.toolset import ToolContext, tool
from codeplane.core import languages


@tool("read_lints", "Report lint errors: ruff for Python files, syntax errors (tree-sitter) "
      "for other languages. Pass files or directories (default: the whole workspace).",
      {"paths": {"type": "array", "items": {"type": "string"}}}, (), "read",
      "lint fewer files at a time")
def read_lints(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    targets = [env.resolve(p) for p in args.get("paths") or ["."]]
    files = sorted({rel for t in targets for rel in list_files(env, t)})
    py = [f for f in files if f.endswith(".py")]
    problems = _ruff(env, py) if py else []
    for rel in files:
        if not rel.endswith(".py") and languages.language_for(rel) \
                and (source := shown_text(env, env.root / rel)):
            problems += syntax_errors(env.root / rel, source, rel)
    if not problems:
        return f"no lint errors in {len(files)} file(s)", {"count": 0, "files": len(files)}
    return "\n".join(problems), {"count": len(problems), "files": len(files)}


def _ruff(env: Environment, files: list[str]) -> list[str]:
    """ruff inside the sandbox over a read-only workspace; one JSON object per diagnostic,
    so its own error messages (same stream) are told apart."""
    res = env.exec([_ruff_binary(), "check", "--output-format=json-lines", "--no-cache",
                    "--exit-zero", "--", *files], timeout=120, stderr=True)
    found, errors = [], []
    for line in res.output.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            errors.append(line)
    if res.exit_code != 0 and not found:
        raise ToolError(f"ruff failed: {' '.join(errors).strip()[:500] or res.killed}")
    return [f"{env.relative(Path(d['filename']))}:{d['location']['row']}:"
            f"{d['location']['column']}: {d.get('code') or 'syntax'} {d['message']}"
            for d in found]


def _ruff_binary() -> str:
    """ruff's executable, by absolute path, from this installation. Never `python -m ruff`
    (it puts the working directory first on sys.path: a `ruff.py` in the workspace ran on
    the host) nor `import ruff` for `find_ruff_bin` (same risk when the server runs with the
    workspace as its working directory); this is the lookup find_ruff_bin does."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / "ruff"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("ruff")
    if not found:
        raise ToolError("ruff is not installed; pip install ruff")
    return found
