"""The warm start's scripted solver alone, through the run's own environment: what it answers
on a config's train and held-out tasks, beside what the search ranking's top file alone
would score (issue #31: a warm start imitates only the solver's good episodes, so its
success bounds what the warm start teaches).

Per task, as the run makes it (`rl.run.split_tasks`: the run's tasks and wording, with
`--train`/`--heldout` raising the config's `max_train`/`max_heldout`), each snapshot indexed
in the run's own index (`RunIndex`, the config's `[search]`: a snapshot the run indexed costs
a round trip), one greedy episode of the solver (`rl.warmstart.solver_for`) played by the
run's `play` in an in-process `EnvServer` (the config's backend and `[rollout]` settings, the
warm start's: temperature 0, no hooks), scored by the run's verifier. "search alone" is the
top file of `codebase_search`'s file ranking for the task's request, scored the same way.

    flock /tmp/codeplane-cpu.lock python bench/rl/solver.py examples/rl/product.toml \
        --train 38 --heldout 0 --out /tmp/solver-train.jsonl

Prints one line per task (changed files, the search's ranked files, the answer, the reward),
then per split: the solver's mean reward and success (reward 1), the episodes a warm start
with `min_reward` would imitate, and search alone's top-1 success. --out gets one JSON line
per task, with every tool output the solver saw.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from codeplane.config import load_settings
from codeplane.indexing.query import search_workspace
from codeplane.rl.commits import CommitTask, score
from codeplane.rl.config import RunConfig, load_config
from codeplane.rl.envserver import EnvConfig, EnvServer
from codeplane.rl.index import RunIndex
from codeplane.rl.policy import LoraShape, Policy, model_weights
from codeplane.rl.rollout import RolloutConfig, play
from codeplane.rl.run import split_tasks
from codeplane.rl.warmstart import solver_for

_HIT = re.compile(r"^(\S+):\d+-\d+ \(score ", re.MULTILINE)


def tasks_of(cfg: RunConfig, split: str, limit: int | None) -> list[CommitTask]:
    """The split's tasks as the run samples them; `limit` replaces the config's cap."""
    if limit is None:
        return split_tasks(cfg, split)  # type: ignore[arg-type]
    key = "max_train" if split == "train" else "max_heldout"
    tasks = cfg.tasks.model_copy(update={key: limit})
    return split_tasks(cfg.model_copy(update={"tasks": tasks}), split)  # type: ignore[arg-type]


def episode(task: CommitTask, solver: Any, config: RolloutConfig, index: RunIndex,
            backend: str) -> dict[str, Any]:
    """One greedy solver episode and the search ranking's own top file for the request."""
    server, events = EnvServer(EnvConfig(backend=backend)), []
    start = time.monotonic()
    try:
        played = play(solver, server, task, "g", config, on_event=events.append,
                      services=index.services(task))
    finally:
        server.close()
    searched = [e["output"] for e in events
                if e["type"] == "tool_result" and e["name"] == "codebase_search"]
    ranked = list(dict.fromkeys(_HIT.findall("\n".join(searched))))
    assert index.settings is not None
    top = search_workspace(Path(task.snapshot), task.request, 1, index.settings, files=True)
    alone = top[0]["path"] if top else ""
    return {"task": task.id, "request": task.request, "files": list(task.files),
            "searched": ranked, "answer": played.info.get("answer", ""),
            "status": played.info.get("status"), "reward": round(played.reward, 3),
            "search_top": alone, "search_reward": round(score(task, alone), 3),
            "tools": [[e["name"], e["output"]] for e in events if e["type"] == "tool_result"],
            "seconds": round(time.monotonic() - start, 1)}


def summary(split: str, rows: list[dict[str, Any]], min_reward: float) -> None:
    if not rows:
        return
    n = len(rows)
    print(f"{split}: n={n} solver mean reward {statistics.mean(r['reward'] for r in rows):.3f}"
          f" success {sum(r['reward'] == 1.0 for r in rows)}/{n}"
          f" hit {sum(r['reward'] > 0 for r in rows)}/{n}"
          f" imitated (reward >= {min_reward}) {sum(r['reward'] >= min_reward for r in rows)}/{n}"
          f" | search alone top-1 success {sum(r['search_reward'] == 1.0 for r in rows)}/{n}"
          f" hit {sum(r['search_reward'] > 0 for r in rows)}/{n}"
          f" mean {statistics.mean(r['search_reward'] for r in rows):.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a commits-family training run's TOML")
    parser.add_argument("--train", type=int, default=None,
                        help="train tasks (default: the config's max_train)")
    parser.add_argument("--heldout", type=int, default=None,
                        help="held-out tasks (default: the config's max_heldout; 0: none)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/codeplane-solver.jsonl"),
                        help="one JSON line per task, with every tool output the solver saw")
    args = parser.parse_args()
    cfg = load_config(args.config)
    make = solver_for(cfg.tasks.family, cfg.tasks.instruction)
    if make is None or cfg.search.server == "none":
        parser.error("the config needs a family with a solver and a [search] server")
    splits = {s: tasks_of(cfg, s, n) if n != 0 else []
              for s, n in (("train", args.train), ("heldout", args.heldout))}
    greedy = RolloutConfig.model_validate(cfg.rollout.model_copy(
        update={"temperature": 0.0, "hooks": ()}).model_dump())
    settings = load_settings()
    solver = make(Policy(model_weights(cfg.sampler.model, settings), LoraShape()))
    index = RunIndex(cfg.search)
    try:
        index.open()
        started = time.monotonic()
        reports = index.index(t.snapshot for tasks in splits.values() for t in tasks)
        print(f"indexed {len(reports)} snapshots, "
              f"{sum(r.chunks_embedded for r in reports)} chunks embedded, "
              f"{time.monotonic() - started:.0f} s", flush=True)
        with args.out.open("w") as out:
            for split, tasks in splits.items():
                rows = []
                for task in tasks:
                    row = {"split": split, **episode(task, solver, greedy, index,
                                                     cfg.env.backend)}
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps({k: row[k] for k in ("task", "files", "searched",
                                                          "answer", "reward",
                                                          "search_reward")}), flush=True)
                summary(split, rows, cfg.warm_start.min_reward)
    finally:
        index.close()


if __name__ == "__main__":
    main()
