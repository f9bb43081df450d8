"""1,000 episodes with 5 % injected environment faults through the real run loop
(`rl/run.py`: Ray environment servers, bwrap sandboxes, the product's tools, tasks from the
toolz sdist): how many faults of each kind, how many episodes were retried or masked, and
whether the trainer ever saw an exception (the goal: zero trainer crashes).

Faults take their real paths (`rl/envserver.py`): the environment actor's process exits (sandbox
killed), a command or the verifier raises. Each episode makes three fault-checked calls (the
agent lists the workspace with ripgrep, its one grep, the verify), so a per-call rate of 1.70 %
faults 5 % of episode attempts. The policy is scripted (one grep, then the answer) and the
trainer a stand-in: this measures the rollout side, not learning.

    flock /tmp/codeplane-cpu.lock python bench/rl/faults.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from async_vs_sync import ScriptedPolicy, SleepTrainer

from codeplane.rl.config import RunConfig
from codeplane.rl.run import TrainingRun


class CrashCounter(SleepTrainer):
    """Counts exceptions raised while the trainer steps (there should be none)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.crashes = 0
        self.groups = 0

    def step(self, groups: list) -> dict[str, float]:
        try:
            self.groups += len(groups)
            return super().step(groups)
        except Exception:
            self.crashes += 1
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--episode-fault-rate", type=float, default=0.05)
    parser.add_argument("--in-flight", type=int, default=4)
    args = parser.parse_args()
    per_call = 1 - (1 - args.episode_fault_rate) ** (1 / 3)
    group, groups = 4, 2
    with tempfile.TemporaryDirectory(prefix="rl-faults-") as tmp:
        config = RunConfig.model_validate({
            "steps": args.episodes // (group * groups), "out": str(Path(tmp) / "run"),
            "trainer_kind": "none", "tasks": {"train": ["toolz==1.0.0"], "max_train": 64},
            "rollout": {"in_flight": args.in_flight, "group_size": group,
                        "groups_per_step": groups, "max_staleness": 2, "retries": 2},
            "env": {"fault_rate": per_call, "seed": 1},
            "search": {"server": "none"},  # the scripted policy never searches
            "ray": {"num_cpus": 2, "env_cpus": 0.25, "call_timeout": 60}})
        trainer = CrashCounter()
        summary = TrainingRun(config).train(ScriptedPolicy(0.0, max_turns=2), trainer)
        lines = (Path(tmp) / "run" / "steps.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    masked = sum(r["masked"] for r in records)
    attempts = summary["episodes"] + summary["env_faults"] - masked
    print(json.dumps({
        "episodes": summary["episodes"], "steps": summary["steps"],
        "env_faults": summary["env_faults"], "faults": summary["faults"],
        "fault_rate_per_attempt": round(summary["env_faults"] / attempts, 4),
        "masked_episodes": masked, "trained_groups": trainer.groups,
        "trainer_steps": trainer.steps, "trainer_crashes": trainer.crashes,
        "trainer_restarts": summary["trainer_restarts"],
        "reward_mean_last": summary["reward_last"], "seconds": summary["seconds"],
        "samples_per_second": summary["samples_per_second"]}, indent=2))


if __name__ == "__main__":
    main()
