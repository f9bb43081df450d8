"""`codeplane model ...` as a user runs it: real subprocesses, real weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import WEIGHTS_HOME, make_settings

SMALL_SHA = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def cli(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "CODEPLANE_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-m", "codeplane", *args], check=False, env=env,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_list_and_info_json(tmp_path):
    home = make_settings(tmp_path / "home").home
    rows = json.loads(cli(home, "model", "list", "--json").stdout)
    assert {r["name"] for r in rows} >= {"code-small", "code-medium"}
    info = json.loads(cli(home, "model", "info", "code-small", "--json").stdout)
    assert info["state"] == "ok" and info["sha256"] == SMALL_SHA
    assert info["bytes"] == 491_400_064 and info["context_length"] == 32768
    assert {"chat", "tools", "fim"} <= set(info["capabilities"])


def test_unknown_model_is_a_clear_error(tmp_path):
    proc = cli(tmp_path, "model", "info", "gpt-9", check=False)
    assert proc.returncode == 2 and "unknown model 'gpt-9'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = cli(tmp_path, "model", "pull", "gpt-9", check=False)
    assert proc.returncode == 2 and "code-small" in proc.stderr


def test_register_any_gguf_file(tmp_path):
    home = tmp_path / "home"
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    proc = cli(home, "model", "add", "mine", str(junk), check=False)
    assert proc.returncode == 2 and "not a GGUF file" in proc.stderr
    real = WEIGHTS_HOME / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    cli(home, "model", "add", "mine", str(real), "--fim")
    info = json.loads(cli(home, "model", "info", "mine", "--json").stdout)
    assert info["state"] == "ok" and info["builtin"] is False and "fim" in info["capabilities"]
    assert info["architecture"] == "qwen2"
    cli(home, "model", "remove", "mine")
    assert cli(home, "model", "info", "mine", check=False).returncode == 2


def test_broken_registry_file_is_a_clear_error(tmp_path):
    registry = tmp_path / "models" / "registry.json"
    registry.parent.mkdir(parents=True)
    registry.write_text('{"mine": ')
    proc = cli(tmp_path, "model", "list", check=False)
    assert proc.returncode == 2 and "registry.json is not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert registry.read_text() == '{"mine": '


def test_pull_is_verified_interruptible_and_idempotent(tmp_path):
    home = tmp_path / "home"
    target = home / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    partial = target.with_name(target.name + ".partial")
    env = {**os.environ, "CODEPLANE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "codeplane", "model", "pull", "code-small"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (partial.exists() and partial.stat().st_size > 50_000_000):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.kill()  # interrupted mid-assembly
    proc.wait()
    assert not target.exists()  # a half-written file is never in place
    info = json.loads(cli(home, "model", "info", "code-small", "--json").stdout)
    assert info["state"] == "missing"

    cli(home, "model", "pull", "code-small")
    info = json.loads(cli(home, "model", "info", "code-small", "--json").stdout)
    assert info["state"] == "ok" and info["sha256"] == SMALL_SHA
    assert not partial.exists()

    start = time.monotonic()
    cli(home, "model", "pull", "code-small")  # already verified: nothing to do
    assert time.monotonic() - start < 10

    with target.open("r+b") as fh:  # flip bytes in the middle: same size, new mtime
        fh.seek(200_000_000)
        fh.write(b"\xff" * 16)
    info = json.loads(cli(home, "model", "info", "code-small", "--json").stdout)
    assert info["state"] == "corrupt"
