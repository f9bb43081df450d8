"""`codeplane doctor`: what this machine can run, checked the way the server will run it.

Each check says ok, warn (something optional is missing) or fail (something the settings need
is broken), with a one-line fix. Anything that touches llama.cpp runs in a child process
(`python -m codeplane.doctor decode NAME`), so a build that uses instructions this CPU lacks
(SIGILL) or weights that crash the loader (SIGSEGV) are reported with their signal instead of
taking the doctor down. The probes themselves belong to their compartments (the sandbox's
`BwrapRunner.check`, `microvm.unavailable` and `cgroups.describe`, the storage clients); this
module only calls them.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from codeplane.config import Settings

DECODE_TIMEOUT_S = 120.0  # a model load plus one token, on a loaded machine
# CPU flags (as /proc/cpuinfo names them) that decide which llama.cpp kernels can run
CPU_FLAGS = re.compile(r"^(sse4_2|ssse3|avx|avx2|avx_vnni|avx512\w*|amx\w*|f16c|fma|bmi2)$")
# llama.cpp's system-info feature -> the /proc/cpuinfo flag the CPU needs for it
BUILD_NEEDS = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c",
               "FMA": "fma", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f",
               "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
               "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""


def run_checks(settings: Settings) -> list[Check]:
    """Every check, in the order a reader wants them: CPU and build, models, sandboxes,
    storage."""
    flags = cpu_flags()
    return [cpu_check(flags), llama_build_check(settings, flags), *model_checks(settings),
            *sandbox_checks(settings), cgroup_check(), *storage_checks(settings)]


# ---------------------------------------------------------------- CPU and the llama.cpp build

def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_check(flags: set[str]) -> Check:
    shown = " ".join(sorted(f for f in flags if CPU_FLAGS.match(f))) or "none found"
    if "avx2" in flags:
        return Check("cpu", "ok", f"{os.cpu_count()} cores; {shown}")
    return Check("cpu", "warn", f"{os.cpu_count()} cores; {shown} (no AVX2)",
                 "expect several times slower decoding than on an AVX2 CPU")


def llama_build_check(settings: Settings, flags: set[str]) -> Check:
    """The llama.cpp build's CPU features (from a child: a build for a newer CPU dies of
    SIGILL), against what this CPU has."""
    got = _child(settings, ["build"], 60.0)
    if isinstance(got, str):
        return Check("llama.cpp build", "fail", got, _REBUILD)
    features = dict(re.findall(r"(\w+) = (\d+)", got["system_info"]))
    enabled = sorted(name for name, on in features.items() if on == "1")
    missing = [name for name in enabled if name in BUILD_NEEDS and BUILD_NEEDS[name] not in flags]
    detail = f"llama-cpp-python {got['version']}: {' '.join(enabled) or 'no CPU features'}"
    if missing and flags:  # no flags: /proc/cpuinfo unreadable, nothing to compare
        return Check("llama.cpp build", "fail",
                     f"{detail}; this CPU lacks {' '.join(missing)}", _REBUILD)
    return Check("llama.cpp build", "ok", detail)


_REBUILD = ("rebuild llama-cpp-python on this machine: pip install --force-reinstall "
            "--no-binary llama-cpp-python --no-deps llama-cpp-python")


# ---------------------------------------------------------------- models

def model_checks(settings: Settings) -> list[Check]:
    """One token decoded by every installed model, each in its own child process, loaded as
    the engine loads it; models not installed are a warning."""
    from codeplane.models.registry import ModelRegistry

    checks = []
    for spec in ModelRegistry(settings).all():
        name = f"model {spec.name}"
        if not spec.file_path(settings).is_file():
            fix = (f"codeplane model pull {spec.name}" if spec.source else
                   f"codeplane model add {spec.name} PATH, or codeplane model remove {spec.name}")
            checks.append(Check(name, "warn", "not installed", fix))
            continue
        got = _child(settings, ["decode", spec.name], DECODE_TIMEOUT_S)
        if isinstance(got, str):
            fix = (f"codeplane model pull {spec.name} --force" if spec.source else
                   f"re-register a working GGUF: codeplane model add {spec.name} PATH")
            checks.append(Check(name, "fail", got, fix))
        else:
            checks.append(Check(name, "ok", f"loaded in {got['load_s']:.1f} s, one token in "
                                            f"{got['decode_s'] * 1000:.0f} ms"))
    return checks


def _child(settings: Settings, args: list[str], timeout: float) -> dict | str:
    """Run `python -m codeplane.doctor ARGS` with these settings: its JSON answer, or why it
    has none (killed by a signal, an error, a timeout) as one line."""
    cmd = [sys.executable, "-m", "codeplane.doctor", *args]
    if settings.config_file and settings.config_file.is_file():
        cmd += ["--config", str(settings.config_file)]
    env = {**os.environ, "CODEPLANE_HOME": str(settings.home)}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False, preexec_fn=_no_core_dump)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:.0f} s"
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        return f"the child process was killed by {sig} ({_SIGNALS.get(sig, 'a crash')})"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return lines[-1][:300]
    try:  # the last line: a library may print before it
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"the child process answered no JSON: {done.stdout[-200:]!r}"


_SIGNALS = {"SIGILL": "the build uses CPU instructions this machine lacks",
            "SIGSEGV": "llama.cpp crashed", "SIGBUS": "the weights file is truncated or "
            "changed while mapped", "SIGKILL": "out of memory?", "SIGABRT": "llama.cpp aborted"}


def _no_core_dump() -> None:
    """A crashing child leaves no core file the size of its model behind."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# ---------------------------------------------------------------- sandboxes and cgroups

def sandbox_checks(settings: Settings) -> list[Check]:
    """The sandbox backends the server may use: bwrap (also under `pool`), slirp4netns for
    sandboxes with network, KVM and QEMU for `microvm`. A backend in `serve.backends` that
    cannot run fails; one not configured is a warning."""
    from codeplane.sandbox import BwrapRunner, SandboxUnavailable
    from codeplane.sandbox.microvm import unavailable

    backends = settings.serve.backends
    needed = "bwrap" in backends or "pool" in backends
    checks = []
    with tempfile.TemporaryDirectory(prefix="codeplane-doctor-") as tmp:
        try:
            BwrapRunner(Path(tmp))
            checks.append(Check("sandbox bwrap", "ok", "bubblewrap starts a sandbox"))
        except SandboxUnavailable as exc:
            checks.append(Check("sandbox bwrap", "fail" if needed else "warn", str(exc),
                                "apt-get install bubblewrap util-linux"))
    if shutil.which("slirp4netns"):
        checks.append(Check("sandbox network", "ok", "slirp4netns installed"))
    else:
        checks.append(Check("sandbox network", "fail" if settings.serve.allow_network
                            else "warn", "slirp4netns is missing: sandboxes cannot have "
                            "network", "apt-get install slirp4netns"))
    problem = unavailable()
    if problem is None:
        checks.append(Check("sandbox microvm", "ok", "KVM and QEMU usable"))
    else:
        checks.append(Check("sandbox microvm", "fail" if "microvm" in backends else "warn",
                            problem, "needed only for the microvm backend (docs/microvm.md)"))
    return checks


def cgroup_check() -> Check:
    """Which cgroup hierarchy sandboxes use and what bounds their memory and processes, as
    the sandbox itself found it (`sandbox.cgroups.describe`)."""
    from codeplane.sandbox import cgroups

    found = cgroups.describe()
    where = ", ".join(f"{name} at {path}" for name, path in found["cgroups"].items())
    detail = (f"{found['note']}: {where or 'no sandbox cgroups'}; memory bounded "
              f"{found['memory']}; processes bounded {found['pids']}")
    if set(found["cgroups"]) >= set(cgroups.CONTROLLERS):
        return Check("cgroups", "ok", detail)
    return Check("cgroups", "warn", detail,
                 "give sandboxes memory and pids cgroups: run the server as root, under "
                 "systemd with Delegate=yes (cgroup v2), or hand it <mount>/<controller>/"
                 f"{cgroups.PARENT} (cgroup v1); docs/agent.md, \"Sandbox\"")


# ---------------------------------------------------------------- storage

def storage_checks(settings: Settings) -> list[Check]:
    """The configured database and object store, reached with their own clients (the
    defaults, a local SQLite file and directory, need no check)."""
    from codeplane.storage.database import Database, DatabaseError
    from codeplane.storage.objects import ObjectStore, StorageError

    cfg = settings.storage
    checks = []
    if cfg.database:
        try:
            db = Database(_bounded(cfg.database))
            try:
                revision = db.revision()
            finally:
                db.close()
            shown = db.engine.url.render_as_string(hide_password=True)
            checks.append(Check("database", "ok", f"{shown}: schema revision "
                                                  f"{revision or 'none yet (serve creates it)'}"))
        except DatabaseError as exc:
            checks.append(Check("database", "fail", str(exc),
                                "start the database or fix [storage] database"))
    if cfg.objects:
        try:
            store = ObjectStore.open(cfg.objects, endpoint_url=cfg.endpoint_url,
                                     region=cfg.region)
            checks.append(Check("object store", "ok", f"{store.url} reachable"))
        except StorageError as exc:
            checks.append(Check("object store", "fail", str(exc),
                                "fix [storage] objects/endpoint_url or the AWS_* credentials"))
    return checks


def _bounded(url: str) -> str:
    """A PostgreSQL URL with a connect timeout (libpq waits forever by default for a host that
    drops packets): the doctor answers even then."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url  # Database reports it
    if not parsed.drivername.startswith("postgres") or "connect_timeout" in parsed.query:
        return url
    return parsed.update_query_dict({"connect_timeout": "5"}).render_as_string(
        hide_password=False)


# ---------------------------------------------------------------- the child process

def _child_main(argv: list[str]) -> int:
    """`python -m codeplane.doctor build|decode NAME [--config PATH]`: one JSON line."""
    import argparse

    from codeplane.config import load_settings

    parser = argparse.ArgumentParser(prog="python -m codeplane.doctor")
    parser.add_argument("what", choices=("build", "decode"))
    parser.add_argument("name", nargs="?")
    parser.add_argument("--config", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.what == "build":
            import llama_cpp

            answer = {"version": llama_cpp.__version__,
                      "system_info": llama_cpp.llama_print_system_info().decode()}
        else:
            answer = _decode_one(load_settings(args.config), args.name)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer, as one line
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0


def _decode_one(settings: Settings, name: str) -> dict:
    from codeplane.models.engine import Decoding, LocalModel
    from codeplane.models.registry import ModelRegistry

    start = time.perf_counter()
    model = LocalModel(ModelRegistry(settings).get(name), settings)  # as the engine loads it
    loaded = time.perf_counter()
    model.generate(model.tokenize("def hello():"), Decoding(max_tokens=1))
    return {"load_s": loaded - start, "decode_s": time.perf_counter() - loaded}


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
