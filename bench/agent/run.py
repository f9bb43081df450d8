"""Agent task suite: resolve rate, steps and wall time per task, for codeplane's agent and for
mini-swe-agent driving the same local model through the same `codeplane serve` endpoint.

Each task in bench/agent/tasks/NAME/ has `repo/` (copied to a fresh workspace) or names a
third-party `snapshot` (fetched on first use, snapshots.py), `task.json` (`prompt`, `check` - a
shell command run in the sandbox after the agent stops - and a reference `solution`), and
optionally `check/` files copied over the workspace before checking so an agent cannot pass by
editing the tests.

    python bench/agent/run.py --validate          # checks fail before, pass after `solution`
    python bench/agent/run.py --models code-small,code-medium --harness codeplane,mini \
        --lock /tmp/codeplane-cpu.lock --out /tmp/agent-bench.jsonl

`--search none|dense|hybrid` measures what `codebase_search` is worth: the tool removed, or
the workspace indexed first and searched dense-only (the old search) or hybrid (the default);
see docs/search.md. `--search-description TEXT` and `--search-position N` change only what the
model is told about that tool (its description, its place in the list), to compare: the
product's is fifth (`--search-position 4`); session 8's "hint" variant is `--search-position 0`
with its text in docs/search.md.
`--setup model` runs each model the way `codeplane agent --model NAME` does: in the agent
setup a trained model was registered with (the server's `/v1/models` `agent_setup`: toolset,
tool output limit, answer turn, hooks, turns and tokens), the product's for other models;
`--setup product` (the default, as the suite always ran) ignores a recorded setup. Options
given explicitly (`--max-steps`, `--config`) win over either, as in the CLI; where neither sets
them, the suite's `LIMITS` apply. Each row records the setup it ran (`setup`, `agent_setup`).
`--task-seconds N` cancels a run after N seconds of wall time (the checker still runs), so a
suite fits a time box on a loaded machine.

`--lock` takes the shared CPU lock around each task (not the whole suite), so other heavy
jobs on the machine interleave instead of distorting the timings.

mini-swe-agent runs from its own virtualenv (`--mini-python`, default /tmp/mswea-venv); it is
not a codeplane dependency: `python -m venv /tmp/mswea-venv &&
/tmp/mswea-venv/bin/pip install mini-swe-agent`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from codeplane.agent.env import local_environment
from codeplane.agent.loop import Agent, Transcript
from codeplane.agent.services import tool_services
from codeplane.agent.setup import AgentSetup, Choice, record, resolve
from codeplane.agent.tools import default_toolset
from codeplane.agent.toolset import Toolset
from codeplane.core.chat import HttpChatModel
from codeplane.sandbox import BwrapRunner, Limits

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from snapshots import SnapshotError, snapshot

TASKS = HERE / "tasks"
# The suite's turn and token limits where neither a model's recorded setup nor the command sets
# them: the product's own (25 turns of 1,024 tokens) outlast a task's time box on this CPU.
LIMITS = {"max_steps": 12, "max_tokens": 512}


def load_tasks(only: list[str] | None) -> list[tuple[str, dict]]:
    tasks = []
    for d in sorted(TASKS.iterdir()):
        if d.is_dir() and (not only or any(d.name.startswith(o) for o in only)):
            tasks.append((d.name, json.loads((d / "task.json").read_text())))
    return tasks


def workspace(name: str, task: dict, root: Path) -> Path:
    ws = root / name
    shutil.copytree(snapshot(task["snapshot"]) if "snapshot" in task else TASKS / name / "repo",
                    ws)
    return ws


def check(name: str, task: dict, ws: Path) -> tuple[bool, str]:
    extra = TASKS / name / "check"
    if extra.is_dir():
        shutil.copytree(extra, ws, dirs_exist_ok=True)
    res = BwrapRunner(ws).run(task["check"], ws, Limits(timeout=120))
    return res.exit_code == 0, res.output[-400:]


def validate(tasks: list[tuple[str, dict]]) -> int:
    """A checker must fail on the untouched repo and pass after the reference solution."""
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, task in tasks:
            before, _ = check(name, task, workspace(name, task, Path(tmp) / "before"))
            ws = workspace(name, task, Path(tmp) / "after")
            BwrapRunner(ws).run(task["solution"], ws, Limits())
            after, out = check(name, task, ws)
            ok = not before and after
            bad += not ok
            print(f"{name:24s} fails-before={not before} passes-after={after}"
                  + ("" if ok else f"  <-- BROKEN {out}"))
    return bad


SEARCH_MODES = ("none", "dense", "hybrid")


def search_setup(mode: str | None, ws: Path, server_url: str, home: Path, key_file: Path
                 ) -> tuple[Toolset | None, object, float]:
    """(toolset, settings, seconds spent indexing) for `--search`: "none" removes
    codebase_search from the toolset; "dense" (the old search) and "hybrid" (the default) index
    the workspace on the run's server first. Unset: the tool is offered on an unindexed
    workspace, as the suite always ran. One `key_file` for every task lets the server's
    embedding cache serve tasks that share a snapshot (embedding is not what is measured)."""
    if mode is None:
        return None, None, 0.0
    if mode == "none":
        return Toolset(t for t in default_toolset().tools.values()
                       if t.name != "codebase_search"), None, 0.0
    from codeplane.config import load_settings
    from codeplane.indexing.sync import sync

    # small upload batches: on a loaded machine 256 chunks outlast the client's HTTP timeout
    settings = load_settings(home=home, server=server_url, indexing={
        "fusion": mode, "key_file": str(key_file), "batch_chunks": 32})
    started = time.monotonic()
    sync(ws, settings)
    return None, settings, round(time.monotonic() - started, 1)


def described(toolset: Toolset, text: str | None, position: int | None) -> Toolset:
    """`toolset` with codebase_search described by `text` and/or offered at `position` in the
    list, the tool itself unchanged: a variant of what the model is told about search, to
    compare against the default (its own description, fifth in the list)."""
    search = toolset.tools["codebase_search"]
    others = [t for t in toolset.tools.values() if t is not search]
    at = list(toolset.tools.values()).index(search) if position is None else position
    return Toolset(others[:at] + [dataclasses.replace(search, description=text or
                                                      search.description)] + others[at:])


def agent_setup(recorded: dict | None, choice: Choice, chosen: dict) -> AgentSetup:
    """What codeplane's agent runs with, resolved as `codeplane agent --setup CHOICE` does
    (agent/setup.py): the model's `recorded` setup unless `choice` is "product", then what the
    command `chosen` explicitly (None: not chosen); the suite's LIMITS only where neither sets
    a limit, so a trained model keeps its own turns and tokens."""
    kept = (recorded or {}) if choice == "model" else {}
    limits = {k: v for k, v in LIMITS.items() if k not in kept}
    return resolve(recorded, choice,
                   **limits | {k: v for k, v in chosen.items() if v is not None})


def run_codeplane(task: dict, ws: Path, chat: HttpChatModel, setup: AgentSetup,
                  transcript: Path, toolset: Toolset | None = None,
                  settings: object = None, seconds: float | None = None) -> dict:
    """One agent run; `seconds` cancels it after that much wall time (status "cancelled"),
    so a suite on a loaded machine fits its time box: the checker still judges what the
    agent changed before the cut."""
    events = Transcript(transcript)
    cancel = threading.Event()
    agent = Agent(chat, local_environment(ws), setup.config, on_event=events,
                  toolset=toolset, cancel=cancel, hooks=setup.hooks,
                  services=tool_services(settings) if settings is not None else None)
    timer = threading.Timer(seconds, cancel.set) if seconds else None
    if timer:
        timer.start()
    try:
        result = agent.run(task["prompt"])
    finally:
        if timer:
            timer.cancel()
        events.close()
    return {"status": result.status, "steps": result.steps, "tool_calls": result.tool_calls,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens, "error": result.error}


def run_mini(task: dict, ws: Path, url: str, model: str, steps: int, python: str,
             transcript: Path, config: str) -> dict:
    proc = subprocess.run([python, str(HERE / "mini_runner.py"), "--task", task["prompt"],
                           "--cwd", str(ws), "--model", model, "--base-url", url,
                           "--step-limit", str(steps), "--out", str(transcript),
                           "--config", config],
                          capture_output=True, text=True, timeout=3600, check=False)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": "error", "steps": 0, "error": proc.stderr[-800:]}


def start_server() -> tuple[str, object]:
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from conftest import LiveServer, free_port  # the same loopback server the tests use

    from codeplane.config import load_settings
    from codeplane.server.app import create_app

    server = LiveServer(create_app(load_settings()), free_port()).start()
    return server.url, server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--tasks", help="comma-separated name prefixes (default: all)")
    ap.add_argument("--models", default="code-small,code-medium")
    ap.add_argument("--harness", default="codeplane,mini")
    ap.add_argument("--server", help="running codeplane server (default: start one)")
    ap.add_argument("--max-steps", type=int, help="turns per run (default: the model's "
                    f"recorded setup with --setup model, else {LIMITS['max_steps']})")
    ap.add_argument("--setup", choices=("model", "product"), default="product",
                    help="model: the agent setup a trained model was registered with, as "
                    "`codeplane agent` runs it (the product's for other models); product: "
                    "the product's defaults (codeplane harness only)")
    ap.add_argument("--task-seconds", type=float, help="cancel a codeplane run after this "
                    "much wall time (indexing not counted); the checker still runs")
    ap.add_argument("--mini-python", default="/tmp/mswea-venv/bin/python")
    ap.add_argument("--mini-config", choices=("textbased", "toolcall"), default="textbased")
    ap.add_argument("--out", type=Path, default=Path("/tmp/agent-bench.jsonl"))
    ap.add_argument("--lock", type=Path, help="flock this file around each task")
    ap.add_argument("--config", default="{}", help="AgentConfig overrides as JSON, e.g. "
                    '\'{"toolset": "core", "required_steps": 0}\' (a variant to compare; '
                    "wins over --setup)")
    ap.add_argument("--search", choices=SEARCH_MODES,
                    help="codebase_search removed (none), or the workspace indexed and searched "
                    "dense-only (the old search) or hybrid (the default); codeplane harness only")
    ap.add_argument("--search-description", help="codebase_search's description as the model "
                    "sees it (a variant to compare; default: the product's)")
    ap.add_argument("--search-position", type=int,
                    help="offer codebase_search at this place in the tool list, 0 = first "
                    "(a variant to compare; default: the product's, fifth)")
    ap.add_argument("--label", default="", help="variant name recorded in each row")
    ap.add_argument("--summarize", type=Path, help="print the table for a results file")
    args = ap.parse_args()
    if args.summarize:
        summarize([json.loads(line) for line in args.summarize.read_text().splitlines()],
                  args.summarize.with_suffix(""))
        return 0
    tasks = load_tasks(args.tasks.split(",") if args.tasks else None)
    try:  # the third-party trees first: offline, say so before any server starts
        for name in {task["snapshot"] for _, task in tasks if "snapshot" in task}:
            snapshot(name)
    except SnapshotError as exc:
        ap.exit(2, f"error: {exc}\n")
    if args.validate:
        return 1 if validate(tasks) else 0
    url, server = (args.server, None) if args.server else start_server()
    base = url.rstrip("/") + "/v1"
    rows = []
    runs_dir = args.out.with_suffix("")
    runs_dir.mkdir(parents=True, exist_ok=True)
    try:
        for model in args.models.split(","):
            for harness in args.harness.split(","):
                for name, task in tasks:
                    with cpu_lock(args.lock):
                        rows.append(one(harness, model, name, task, base, args, runs_dir))
                    with args.out.open("a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    finally:
        if server:
            server.stop()
    summarize(rows, runs_dir)
    return 0


@contextlib.contextmanager
def cpu_lock(path: Path | None):
    if path is None:
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def one(harness: str, model: str, name: str, task: dict, base: str, args, runs_dir: Path):
    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(name, task, Path(tmp))
        transcript = transcript_path(runs_dir, harness, args.label, model, name)
        start = time.monotonic()
        index_seconds, setup = 0.0, None
        if harness == "codeplane":
            toolset, settings, index_seconds = search_setup(
                args.search, ws, base.removesuffix("/v1"), Path(tmp) / "client",
                runs_dir / "search.key")
            if args.search_description or args.search_position is not None:
                toolset = described(toolset or default_toolset(), args.search_description,
                                    args.search_position)
            with contextlib.closing(HttpChatModel(base, model)) as chat:
                chosen = agent_setup(chat.listing().get("agent_setup"), args.setup,
                                     {"max_steps": args.max_steps, **json.loads(args.config)})
                setup = {"setup": args.setup,
                         "agent_setup": record(chosen.config, chosen.hooks)}
                start = time.monotonic()
                info = run_codeplane(task, ws, chat, chosen, transcript, toolset, settings,
                                     args.task_seconds)
        else:
            info = run_mini(task, ws, base, model, args.max_steps or LIMITS["max_steps"],
                            args.mini_python, transcript, args.mini_config)
        seconds = round(time.monotonic() - start, 1)
        resolved, tail = check(name, task, ws)
    row = {"harness": harness, "label": args.label, "model": model, "task": name,
           "resolved": resolved, "search": args.search, "index_seconds": index_seconds,
           "seconds": seconds, **info, **(setup or {}), "check_tail": "" if resolved else tail}
    print(f"{harness:9s} {model:11s} {name:24s} {'PASS' if resolved else 'fail'} "
          f"steps={info.get('steps')} {seconds:6.1f}s {info.get('status')}", flush=True)
    return row


def transcript_path(runs_dir: Path, harness: str, label: str, model: str, task: str) -> Path:
    return runs_dir / f"{harness}{label and '-' + label}-{model}-{task}.jsonl"


def searches(transcript: Path) -> int:
    """codebase_search calls in a codeplane run's transcript (0 where none was kept): what a
    model trained to search first does with the tool."""
    if not transcript.exists():
        return 0
    events = (json.loads(line) for line in transcript.read_text().splitlines())
    return sum(e["type"] == "tool_start" and e["name"] == "codebase_search" for e in events)


def summarize(rows: list[dict], runs_dir: Path) -> None:
    """Per harness and model: overall, and on the tasks every harness of that model ran;
    then the tasks each resolved. Tool calls are per model turn; searches are codebase_search
    calls counted in the transcripts under `runs_dir`."""
    rows = [{**r, "searches": searches(transcript_path(runs_dir, r["harness"], r.get("label", ""),
                                                        r["model"], r["task"])),
             "harness": r["harness"] + (f":{r['label']}" if r.get("label") else "")}
            for r in rows]
    print(f"\n{'harness':14s} {'model':11s} {'tasks':5s} resolved  mean_steps  mean_s  total_s"
          "  calls/turn  searches")
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        harnesses = sorted({r["harness"] for r in mine})
        common = set.intersection(*({r["task"] for r in mine if r["harness"] == h}
                                    for h in harnesses))
        for harness in harnesses:
            group = [r for r in mine if r["harness"] == harness]
            _line(harness, model, "all", group)
            if len(harnesses) > 1 and len(common) < len(group):
                _line(harness, model, "both", [r for r in group if r["task"] in common])
    for harness, model in sorted({(r["harness"], r["model"]) for r in rows}):
        solved = [r["task"][:2] for r in rows
                  if (r["harness"], r["model"]) == (harness, model) and r["resolved"]]
        print(f"{harness} {model} resolved: {' '.join(solved) or '-'}")


def _line(harness: str, model: str, label: str, group: list[dict]) -> None:
    solved = sum(r["resolved"] for r in group)
    steps = sum(r.get("steps") or 0 for r in group) / len(group)
    secs = sum(r["seconds"] for r in group)
    calls = sum(r.get("tool_calls") or 0 for r in group) / max(1, sum(r.get("steps") or 0
                                                                       for r in group))
    print(f"{harness:14s} {model:11s} {label:5s} {solved:2d}/{len(group):<2d}    {steps:7.1f}  "
          f"{secs / len(group):6.1f}  {secs:7.0f}  {calls:10.2f}  "
          f"{sum(r['searches'] for r in group):8d}")


if __name__ == "__main__":
    sys.exit(main())
