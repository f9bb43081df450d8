"""Shared pieces of the RL rollout tests: a small repository and a deterministic policy.

The policy is a stand-in for the trained model (the rollout side must not depend on what a
model happens to sample): it greps for the task's quoted docstring with the product's real
tools, in a real sandbox, and answers `path:line` from the grep output - so its reward is
1.0 only when the environment, the tools and the verifier all work."""

from __future__ import annotations

import os

# Before anything imports ray: Ray's single-machine mode, every port on 127.0.0.1 (run.start_ray)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from codeplane.core.chat import Sampling, Turn

SRC = str(Path(__file__).resolve().parents[2] / "src")

SHAPES = '''class Circle:
    """A round shape with a radius and a centre."""

    def __init__(self, r):
        self.r = r

    def area(self):
        """Compute the area of the circle from its radius."""
        return 3.14 * self.r ** 2


def perimeter(r):
    """Return the length of the border of a circle."""
    return 2 * 3.14 * r
'''


def make_repo(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "shapes.py").write_text(SHAPES)
    return root


class GrepPolicy:
    """Turn 1: grep the quoted summary; turn 2: answer with the first hit's path:line.
    `stall=True` never answers (a straggler). Stamps every turn with `version`."""

    name = "grep-policy"

    def __init__(self, stall: bool = False) -> None:
        self.version, self.stall = 0, stall
        self.loads: list[int] = []
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {"name": self.name}

    def close(self) -> None:
        pass

    def load_weights(self, weights: object, version: int) -> None:
        with self._lock:
            self.version = version
            self.loads.append(version)

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        summary = re.search(r'"(.*)"\?', messages[1]["content"]).group(1)
        tool_out = [m["content"] for m in messages if m["role"] == "tool"]
        if self.stall or not tool_out:
            call = {"id": "call_0", "type": "function", "function": {
                "name": "grep", "arguments": json.dumps({"pattern": summary})}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            hit = re.match(r"([^:\n]+):(\d+):", tool_out[-1])
            message = {"role": "assistant",
                       "content": f"{hit.group(1)}:{hit.group(2)}" if hit else "no idea"}
        return Turn(message, "stop", {}, [-0.5, -0.25], [1, 2, 3], [7, 8],
                    policy_version=self.version)




def require_ray():
    """Ray, or a skip. `importorskip` alone takes a stray `ray/` directory on sys.path (Ray's
    own session directory /tmp/ray, when tests run from /tmp) for the package."""
    ray = pytest.importorskip("ray")
    if not hasattr(ray, "init"):
        pytest.skip("ray is not installed (only a directory named ray is on sys.path)")
    return ray


def rl_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    """`codeplane rl train ARGS` in a subprocess, as a user runs it: without the loopback
    switch this test process set for its own Ray; `env` added to the environment."""
    base = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    return subprocess.run([sys.executable, "-m", "codeplane", "rl", "train", *args],
                          capture_output=True, text=True, env=base | {"PYTHONPATH": SRC} | (
                              env or {}), timeout=timeout, check=False)


def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path
