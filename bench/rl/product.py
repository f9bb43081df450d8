"""Measured through the product (issue #31 item 6): a training run's held-out tasks asked of the
product's agent - `codeplane agent`'s construction, a `codeplane serve` on loopback, the
product's index - once per model, side by side with what the search tool alone answers.

For each held-out task of CONFIG (`rl.run.split_tasks`: the tasks and wording the run itself
evaluates) and each model: a fresh sandboxed copy of the task's repository (`EnvServer.reset`,
the run's backend), indexed the product's way (`indexing.sync`) in the run's own index
(`RunIndex`: its `[search]` home and key, so the copies of a snapshot the run indexed cost a
round trip per changed file and embed nothing), then the agent as `codeplane agent` builds it
(`HttpChatModel` on a `codeplane serve` of the user's home, which serves the registered
models, `tool_services` of the index's settings, and the agent setup the server lists for the
model - a trained model's recorded setup, else the product's defaults (agent/setup.py) - with
`--max-steps`/`--max-tokens` when given), its answer scored by the run's verifier
(`EnvServer.verify`). A model written `NAME@OTHER` runs in OTHER's recorded setup (the base
model in its trained adapter's setup: training and setup effects apart). "search alone" asks
`codebase_search`'s ranking (files) the task's request and scores its top hit's `path:line`
with the same verifier.

    codeplane model add trained --from-run ~/.codeplane/rl/runs/curve9   # the checkpoint
    flock /tmp/codeplane-cpu.lock python bench/rl/product.py examples/rl/curve.toml \
        --models code-small,trained,code-small@trained --tasks 10 --out /tmp/product.jsonl

Per model: success (reward 1), hit (reward > 0: a right file named), mean reward, the share of episodes that called
codebase_search, tool calls per model turn on turns that read files, turns and seconds per
episode. One JSON line per episode goes to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from codeplane.agent.loop import Agent, Transcript
from codeplane.agent.services import tool_services
from codeplane.agent.setup import AgentSetup, record, resolve
from codeplane.config import Settings, load_settings
from codeplane.core.chat import HttpChatModel
from codeplane.core.serve import child_server
from codeplane.indexing.query import search_workspace
from codeplane.indexing.sync import forget, sync
from codeplane.rl.commits import named_files
from codeplane.rl.config import load_config
from codeplane.rl.envserver import EnvConfig, EnvServer
from codeplane.rl.index import RunIndex
from codeplane.rl.rollout import Conduct
from codeplane.rl.tasks import Task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from solver import tasks_of

SEARCH_ALONE = "search alone"


def episode(task: Task, model: str, client: Settings, chat_url: str,
            args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """One task asked of one model (or of the search ranking alone)."""
    server = EnvServer(EnvConfig(backend=backend))
    start = time.monotonic()
    env = None
    try:
        env = server.open(task)
        sync(env.root, client)
        if model == SEARCH_ALONE:
            hits = search_workspace(env.root, request(task), 1, client, files=True)
            answer = f"{hits[0]['path']}:{hits[0]['start_line']}" if hits else ""
            return {"task": task.id, "model": model, "status": "completed", "answer": answer,
                    "reward": server.verify(answer),
                    "index_seconds": round(time.monotonic() - start, 1)}
        conduct = Conduct()
        chat = HttpChatModel(chat_url, model.partition("@")[0])
        setup = agent_setup(model, chat_url, args)
        agent = Agent(chat, env, setup.config, on_event=conduct, hooks=setup.hooks,
                      services=tool_services(client))
        if args.transcripts:  # the product's transcript format (docs/agent.md)
            kept = Transcript(args.transcripts / f"{model}-{task.id.replace(':', '-')}.jsonl")
            agent.listeners.append(kept)
        indexed = time.monotonic()
        try:
            result = agent.run(task.instruction)
        finally:
            chat.close()
            if args.transcripts:
                kept.close()
        reward = server.verify(result.answer) if result.status == "completed" else 0.0
        return {"task": task.id, "model": model, "status": result.status,
                "answer": result.answer[-400:], "named": named_files(result.answer),
                "files": list(getattr(task, "files", ())), "reward": reward,
                "setup": record(setup.config, setup.hooks), **conduct.as_dict(),
                "seconds": round(time.monotonic() - indexed, 1),
                "index_seconds": round(indexed - start, 1)}
    finally:
        if env is not None:  # each copy is a workspace of its own on the index's server
            forget(env.root, client)
        server.close()


def agent_setup(model: str, chat_url: str, args: argparse.Namespace) -> AgentSetup:
    """As `codeplane agent` builds it: the setup the server lists for the model (for
    `NAME@OTHER`, OTHER's), with the limits given on the command line."""
    listed = HttpChatModel(chat_url, model.rpartition("@")[2])
    try:
        recorded = listed.listing().get("agent_setup")
    finally:
        listed.close()
    return resolve(recorded, max_steps=args.max_steps, max_tokens=args.max_tokens)


def request(task: Task) -> str:
    """What the search ranking is asked: the task's request as its family states it (a
    commit's change request), else the instruction the agent gets."""
    return getattr(task, "request", None) or task.instruction


def summary(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':16s} {'n':>3s} {'success':>8s} {'hit':>5s} {'reward':>7s} {'search%':>8s} "
          f"{'calls/read-turn':>16s} {'turns':>6s} {'s/episode':>10s}")
    for model in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == model]
        reads = [c for r in group for c in r.get("read_turn_calls", [])]
        agentic = model != SEARCH_ALONE
        print(f"{model:16s} {len(group):3d} "
              f"{sum(r['reward'] == 1.0 for r in group) / len(group):8.2f} "
              f"{sum(r['reward'] > 0 for r in group) / len(group):5.2f} "
              f"{statistics.mean(r['reward'] for r in group):7.2f} "
              + (f"{sum(r['searches'] > 0 for r in group) / len(group):8.2f} "
                 f"{statistics.mean(reads) if reads else float('nan'):16.2f} "
                 f"{statistics.mean(r['turns'] for r in group):6.1f} "
                 f"{statistics.mean(r['seconds'] for r in group):10.1f}" if agentic else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the training run's TOML")
    parser.add_argument("--models", default="code-small",
                        help="comma-separated served model names (a trained adapter model "
                             "registered with `codeplane model add --from-run`); NAME@OTHER: "
                             "NAME in OTHER's recorded agent setup")
    parser.add_argument("--heldout", type=int, default=None,
                        help="held-out tasks sampled (default: the config's max_heldout)")
    parser.add_argument("--tasks", type=int, default=10, help="held-out tasks (the first N)")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first SKIP of those (a long measurement in parts)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="default: the model's setup, else the product's")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="default: the model's setup, else the product's")
    parser.add_argument("--no-search-alone", action="store_true")
    parser.add_argument("--transcripts", type=Path,
                        help="a folder for each agent episode's events (what the model said)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/codeplane-product.jsonl"))
    args = parser.parse_args()
    cfg = load_config(args.config)
    if cfg.search.server == "none":
        parser.error("the config's [search] server is \"none\": the harness indexes each task "
                     "copy in the run's index, so it needs one")
    tasks = tasks_of(cfg, "heldout", args.heldout)[args.skip:args.tasks]
    models = [m for m in args.models.split(",") if m] + ([] if args.no_search_alone
                                                         else [SEARCH_ALONE])
    settings = load_settings()
    rows = []
    index = RunIndex(cfg.search)
    with ExitStack() as stack, args.out.open("w") as out:
        stack.callback(index.close)
        client = index.open().settings
        url = stack.enter_context(child_server(settings.home, settings.config_file))
        for model in models:
            for task in tasks:
                row = episode(task, model, client, url + "/v1", args, cfg.env.backend)
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)
    summary(rows)


if __name__ == "__main__":
    main()
