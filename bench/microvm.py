"""microVM backend benchmark, next to bubblewrap in the same run: cold boot to first exec and
exec round trip (a shell command and a trusted program).

    flock /tmp/codeplane-cpu.lock python bench/microvm.py [--boots 5] [--execs 30] [--json]

Uses KVM when it can boot Debian's kernel here, else QEMU's TCG emulator (printed: TCG
numbers say what the protocol costs on this host, not what KVM would).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from codeplane.sandbox import Limits, open_workspace
from codeplane.sandbox.microvm import MicroVMWorkspace, guest_image, kvm_problem

LIMITS = Limits(memory_bytes=512 << 20, tmp_bytes=64 << 20, timeout=120)


def stats(values: list[float]) -> dict[str, float]:
    """p50 and p95 in milliseconds."""
    ms = [v * 1000 for v in values]
    p95 = statistics.quantiles(ms, n=20, method="inclusive")[18] if len(ms) > 1 else ms[0]
    return {"p50_ms": round(statistics.median(ms), 1), "p95_ms": round(p95, 1), "n": len(ms)}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_repo(path: Path) -> Path:
    (path / "pkg").mkdir(parents=True)
    for i in range(50):
        (path / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    return path


def first_exec(ws) -> None:
    res = ws.exec("echo ready", LIMITS)
    assert res.exit_code == 0 and res.output.strip() == "ready", res


def cold(scratch: Path, backend: Callable[[Path], object], rounds: int) -> list[float]:
    """Create a workspace and run its first command, `rounds` times."""
    times = []
    for n in range(rounds):
        root = make_repo(scratch / f"cold-{id(backend)}-{n}")
        start = time.perf_counter()
        ws = backend(root)
        first_exec(ws)
        times.append(time.perf_counter() - start)
        ws.close()
    return times


def round_trips(ws, execs: int) -> dict[str, dict[str, float]]:
    shell = [timed(lambda: ws.exec("true", LIMITS)) for _ in range(execs)]
    program = [timed(lambda: ws.exec(["rg", "--files"], LIMITS)) for _ in range(execs)]
    return {"shell `true`": stats(shell), "program `rg --files`": stats(program)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--boots", type=int, default=5, help="cold boots")
    ap.add_argument("--execs", type=int, default=30, help="round trips per kind")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    accel = "tcg" if kvm_problem() else "kvm"
    start = time.perf_counter()
    image = guest_image()
    report: dict = {"accel": accel, "kvm_problem": kvm_problem(),
                    "guest_image_s": round(time.perf_counter() - start, 2)}
    with tempfile.TemporaryDirectory(prefix="bench-microvm-") as tmp:
        scratch = Path(tmp)
        vm = partial(MicroVMWorkspace, accel=accel, limits=LIMITS, image=image)
        bwrap = partial(open_workspace, backend="bwrap")
        report["cold create to first exec"] = {"microvm": stats(cold(scratch, vm, args.boots)),
                                               "bwrap": stats(cold(scratch, bwrap, args.boots))}
        report["exec round trip"] = {}
        for name, make in (("microvm", vm), ("bwrap", bwrap)):
            ws = make(make_repo(scratch / f"rt-{name}"))
            report["exec round trip"][name] = round_trips(ws, args.execs)
            ws.close()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    print(f"accel: {accel}" + (f" ({report['kvm_problem']})" if report["kvm_problem"] else ""))
    print(f"guest image (cached after the first run): {report['guest_image_s']} s")
    for section in ("cold create to first exec", "exec round trip"):
        print(f"\n{section}")
        for name, value in report[section].items():
            rows = value.items() if "p50_ms" not in value else [("", value)]
            for sub, s in rows:
                print(f"  {name:22} {sub:24} p50 {s['p50_ms']:9.1f} ms  p95 {s['p95_ms']:9.1f} ms"
                      f"  (n={s['n']})")


if __name__ == "__main__":
    main()
