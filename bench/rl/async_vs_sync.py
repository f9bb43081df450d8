"""Async vs synchronous rollouts on heavy-tailed episode lengths: samples/s of the real run
loop (`rl/run.py`: Ray environment servers, bwrap sandboxes, the product's tools, tasks from
the toolz sdist) at staleness k = 0 (synchronous) and k = 2, same tasks, same episode lengths.

The policy is scripted so both modes see exactly the same episodes: it greps for the task's
docstring with the real tools for a heavy-tailed number of turns (log-normal, p99/p50 ~ 20,
capped at 40; keyed on the task and how many episodes of it came before, so each task's
lengths are the same in both modes), sleeping `--turn-seconds` per turn as a GPU sampler
would be busy, then answers `path:line` from the grep hit. The trainer sleeps
`--train-seconds` per step. Sleeping keeps the shared 2-core machine free for the sandboxes,
which do real work.

    flock /tmp/codeplane-cpu.lock python bench/rl/async_vs_sync.py
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from codeplane.core.chat import Cancelled, Sampling, Turn
from codeplane.rl.config import RunConfig
from codeplane.rl.run import TrainingRun


class ScriptedPolicy:
    """Greps the quoted summary for a heavy-tailed number of turns, then answers."""

    name = "scripted-policy"

    def __init__(self, turn_seconds: float, seed: int = 0, max_turns: int = 40) -> None:
        self.version, self.turn_seconds, self.seed = 0, turn_seconds, seed
        self.max_turns = max_turns
        self.seen: Counter = Counter()
        self.lengths: dict[int, tuple[list, int]] = {}  # keeps the list: ids stay unique
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {"name": self.name}

    def close(self) -> None:
        pass

    def load_weights(self, weights: object, version: int) -> None:
        self.version = version

    def _length(self, messages: list[dict]) -> int:
        """Turns this episode takes, fixed when its first turn is asked for."""
        key = id(messages)
        with self._lock:
            if key not in self.lengths:
                task = messages[1]["content"]
                nth = self.seen[task]
                self.seen[task] += 1
                draw = random.Random(f"{self.seed}:{task}:{nth}").gauss(0.7, 1.3)
                turns = max(1, min(self.max_turns - 1, math.ceil(math.exp(draw))))
                self.lengths[key] = (messages, turns)
            return self.lengths[key][1]

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        if (cancel or threading.Event()).wait(self.turn_seconds):
            raise Cancelled  # the run stopped: the manager cuts this episode short
        summary = re.search(r'"(.*)"\?', messages[1]["content"]).group(1)
        outputs = [m["content"] for m in messages if m["role"] == "tool"]
        if len(outputs) < self._length(messages):
            call = {"id": f"call_{len(outputs)}", "type": "function", "function": {
                "name": "grep", "arguments": json.dumps({"pattern": summary[:40]})}}
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            hit = re.match(r"([^:\n]+):(\d+):", outputs[-1] if outputs else "")
            message = {"role": "assistant",
                       "content": f"{hit.group(1)}:{hit.group(2)}" if hit else "not found"}
        return Turn(message, "stop", {}, [-0.5], [1, 2], [3], policy_version=self.version)


class SleepTrainer:
    """A trainer that takes `seconds` per step and keeps a version (the loop's contract)."""

    def __init__(self, seconds: float) -> None:
        self.version, self.seconds, self.steps = 0, seconds, 0

    def step(self, groups: list) -> dict[str, float]:
        time.sleep(self.seconds)
        self.version += 1
        self.steps += 1
        return {"loss": 0.0, "groups": float(len(groups))}

    def nothing_to_learn(self, groups: list) -> None:
        return None

    def weights(self) -> None:
        return None

    def save(self, directory: str) -> None:
        (Path(directory) / "trainer.json").write_text(json.dumps({"version": self.version}))

    def load(self, directory: str) -> None:
        self.version = json.loads((Path(directory) / "trainer.json").read_text())["version"]


def run(staleness: int, args: argparse.Namespace, out: Path) -> dict:
    config = RunConfig.model_validate({
        "steps": args.steps, "out": str(out), "trainer_kind": "none",
        "tasks": {"train": ["toolz==1.0.0"], "max_train": 16},
        "rollout": {"in_flight": args.in_flight, "group_size": 4, "groups_per_step": 2,
                    "max_staleness": staleness, "max_turns": 40, "seed": 1},
        "env": {"fault_rate": args.fault_rate}, "ray": {"num_cpus": 2, "env_cpus": 0.25},
        "search": {"server": "none"}})  # the scripted policy never searches
    policy = ScriptedPolicy(args.turn_seconds)
    summary = TrainingRun(config).train(policy, SleepTrainer(args.train_seconds))
    lengths = sorted(turns for _, turns in policy.lengths.values())
    summary["episode_turns_p50"] = lengths[len(lengths) // 2]
    summary["episode_turns_p99"] = lengths[min(len(lengths) - 1, int(len(lengths) * 0.99))]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--turn-seconds", type=float, default=0.1)
    parser.add_argument("--train-seconds", type=float, default=2.0)
    parser.add_argument("--staleness", type=int, default=2, help="k of the async run")
    parser.add_argument("--fault-rate", type=float, default=0.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
        sync = run(0, args, Path(tmp) / "sync")
        fast = run(args.staleness, args, Path(tmp) / "async")
    keys = ("samples_per_second", "seconds", "episodes", "samples", "max_staleness",
            "reward_last", "episode_turns_p50", "episode_turns_p99")
    print(json.dumps({"sync": {k: sync[k] for k in keys},
                      f"async_k{args.staleness}": {k: fast[k] for k in keys},
                      "speedup": round(fast["samples_per_second"]
                                       / sync["samples_per_second"], 2)}, indent=2))


if __name__ == "__main__":
    main()
