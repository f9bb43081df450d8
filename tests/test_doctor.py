"""`codeplane doctor` as a user runs it: real child processes decoding real weights, a child
that crashes, a configured database that is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import WEIGHTS_HOME, free_port

from codeplane.models.registry import BUILTIN

SMALL = next(spec for spec in BUILTIN if spec.name == "code-small")
# Loaded by every Python process the doctor starts (PYTHONPATH): the child asked to decode
# the model named "crashy" dies of SIGSEGV, as a broken llama.cpp build or bad weights would.
CRASH_HOOK = """import os, signal, sys
if "decode" in sys.orig_argv and "crashy" in sys.orig_argv:
    os.kill(os.getpid(), signal.SIGSEGV)
"""


def home_with(tmp_path: Path, builtins: tuple[str, ...] = (), user: dict | None = None,
              config: str = "") -> Path:
    """A CODEPLANE_HOME whose models/ holds only the named built-ins (linked to the shared
    weights with their verification marker, so nothing is re-hashed) and `user` models."""
    home = tmp_path / "home"
    models = home / "models"
    models.mkdir(parents=True)
    for spec in BUILTIN:
        if spec.name in builtins:
            for name in (spec.filename, spec.filename + ".verified"):
                (models / name).symlink_to(WEIGHTS_HOME / "models" / name)
    if user:
        (models / "registry.json").write_text(json.dumps(user))
    (home / "codeplane.toml").write_text(config)
    return home


def doctor(home: Path, *args: str, hook: Path | None = None) -> subprocess.CompletedProcess:
    paths = [str(hook)] if hook else []
    env = {**os.environ, "CODEPLANE_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([*paths, *sys.path])}
    return subprocess.run([sys.executable, "-m", "codeplane", "doctor", *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def checks(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    report = json.loads(proc.stdout)
    assert report["ok"] == (proc.returncode == 0), proc.stderr
    return {c["name"]: c for c in report["checks"]}


def test_an_installed_model_decodes_in_a_child_process(tmp_path):
    got = checks(doctor(home_with(tmp_path, ("code-small",)), "--json"))
    assert got["model code-small"]["status"] == "ok", got["model code-small"]
    assert "one token in" in got["model code-small"]["detail"]
    medium = got["model code-medium"]
    assert medium["status"] == "warn" and medium["fix"] == "codeplane model pull code-medium"
    assert got["llama.cpp build"]["status"] == "ok" and "AVX" in got["llama.cpp build"]["detail"]
    assert got["cpu"]["status"] in ("ok", "warn")
    for name in ("sandbox bwrap", "sandbox network", "sandbox microvm", "cgroups"):
        assert got[name]["status"] in ("ok", "warn", "fail") and got[name]["detail"]


def test_a_crashing_model_is_reported_with_its_signal_and_fails_the_run(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_HOOK)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(4096))
    weights = str(WEIGHTS_HOME / "models" / SMALL.filename)
    home = home_with(tmp_path, user={"crashy": {"path": weights},
                                     "garbage": {"path": str(garbage)}})
    proc = doctor(home, "--json", hook=hook)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    got = checks(proc)
    crashed = got["model crashy"]
    assert crashed["status"] == "fail" and "SIGSEGV" in crashed["detail"], crashed
    assert crashed["fix"] == "re-register a working GGUF: codeplane model add crashy PATH"
    assert got["model garbage"]["status"] == "fail"
    assert "Failed to load model" in got["model garbage"]["detail"]
    assert "sandbox bwrap" in got and "cgroups" in got  # the checks after it still ran
    text = doctor(home, hook=hook)  # the terminal form says the same
    assert text.returncode == 1 and "FAIL model crashy" in " ".join(text.stdout.split())


def test_unreachable_configured_storage_fails(tmp_path):
    url = f"postgresql://codeplane:s3cret-pw@127.0.0.1:{free_port()}/codeplane"
    config = (f'[storage]\ndatabase = "{url}"\nobjects = "s3://bucket/prefix"\n'
              f'endpoint_url = "http://127.0.0.1:{free_port()}"\n')
    proc = doctor(home_with(tmp_path, config=config), "--json")
    assert proc.returncode == 1
    got = checks(proc)
    database, objects = got["database"], got["object store"]
    assert database["status"] == "fail" and "127.0.0.1" in database["detail"]
    assert "s3cret-pw" not in proc.stdout and database["fix"]
    assert objects["status"] == "fail" and "cannot reach" in objects["detail"]


def test_help_and_bad_input():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = [sys.executable, "-m", "codeplane", "doctor"]
    shown = subprocess.run([*run, "--help"], env=env, capture_output=True, text=True,
                           check=False)
    assert shown.returncode == 0 and "child process" in " ".join(shown.stdout.split())
    bad = subprocess.run([*run, "--config", "/nonexistent.toml"], env=env, capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and "config file not found" in bad.stderr
    assert "Traceback" not in bad.stderr
