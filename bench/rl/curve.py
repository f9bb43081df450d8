"""The learning curve of a run (issue 15, 9b): held-out success before and after training.

    python bench/rl/curve.py ~/.codeplane/rl/runs/curve [--tasks 20] [--png docs/img/x.png]
    python bench/rl/curve.py ~/.codeplane/rl/runs/curve --evaluate examples/rl/curve.toml

The first form reads the run directory (`steps.jsonl`, one line per trainer step;
`heldout.jsonl`, one line per held-out evaluation) and prints one row per step: minutes of
training wall clock (since the evaluation before the first step ended), train reward mean,
the trainer's seconds and the share of the step spent waiting for rollouts, and the held-out
success where it was measured, with its 95 % Wilson interval over the `--tasks` held-out
tasks. It writes the PNG (train reward per step, held-out success with its interval).

`--evaluate CONFIG` measures the last checkpoint on the held-out set with the run's own
evaluation code (`rl.run.evaluate`: one greedy episode per task, llama.cpp with the
checkpoint's LoRA written as a GGUF adapter) and appends the result to `heldout.jsonl`: a run
stopped between two evaluations still gets its "after" number. It needs no torch policy in
memory (the LoRA tensors are read from the checkpoint), so it can run next to a training run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

Z95 = 1.96


def wilson(successes: float, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate: sound at 0 and 1 and for small n, where
    the normal approximation gives intervals outside [0, 1]."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    denom = 1 + Z95 ** 2 / n
    centre = (p + Z95 ** 2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(steps: list[dict[str, Any]], evals: list[dict[str, Any]], tasks: int
          ) -> list[dict[str, Any]]:
    """One row per evaluation before the first step, then per trainer step (trained steps
    counted from 1), with the held-out evaluation made after it, if any."""
    start = evals[0]["time"] if evals and evals[0]["steps"] == 0 else (
        steps[0]["time"] - steps[0]["samples"] / max(steps[0]["samples_per_second"], 1e-9)
        if steps else time.time())
    by_steps = {e["steps"]: e for e in evals if not e.get("phase")}
    rows = []
    if 0 in by_steps:
        rows.append(_row(0, 0.0, None, None, None, by_steps[0], tasks))
    for warm in (e for e in evals if e.get("phase") == "warm_start"):  # after the warm start
        rows.append(_row(0, (warm["time"] - start) / 60, None, None, None, warm, tasks)
                    | {"label": "warm"})
    for line in steps:
        done = line["step"] + 1
        trainer = line.get("trainer") or {}
        rows.append(_row(done, (line["time"] - start) / 60, line.get("reward_mean"),
                         trainer.get("seconds"), line.get("trainer_wait"), by_steps.get(done),
                         tasks))
    for extra in sorted(set(by_steps) - {r["steps"] for r in rows if "label" not in r}):
        rows.append(_row(extra, (by_steps[extra]["time"] - start) / 60, None, None, None,
                         by_steps[extra], tasks))
    return rows


def _row(done: int, minutes: float, reward: float | None, trainer_s: float | None,
         wait: float | None, evaluation: dict[str, Any] | None, tasks: int) -> dict[str, Any]:
    row: dict[str, Any] = {"steps": done, "minutes": minutes, "reward": reward,
                           "trainer_s": trainer_s, "trainer_wait": wait}
    if evaluation is not None:
        success = evaluation["heldout_success"]
        row["heldout"] = success
        row["interval"] = wilson(round(success * tasks), tasks)
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], tasks: int) -> None:
    print(f"{'steps':>5} {'min':>6} {'reward':>6} {'trainer s':>9} {'wait %':>6}  "
          f"held-out success (n={tasks}, 95 % interval)")
    for r in rows:
        held = (f"{r['heldout']:.2f} [{r['interval'][0]:.2f}, {r['interval'][1]:.2f}]"
                if "heldout" in r else "")
        print(f"{r.get('label', r['steps']):>5} {_fmt(r['minutes'], '.1f'):>6} {_fmt(r['reward'], '.3f'):>6} "
              f"{_fmt(r['trainer_s'], '.0f'):>9} {_fmt(r['trainer_wait'], '.0f'):>6}  {held}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Train reward per step and held-out success with its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    trained = [r for r in rows if r["reward"] is not None]
    if trained:
        ax.plot([r["steps"] for r in trained], [r["reward"] for r in trained], marker="o",
                markersize=3, label="train reward (mean of the step's episodes)")
    held = [r for r in rows if "heldout" in r]
    if held:
        ys = [r["heldout"] for r in held]
        errors = [[y - r["interval"][0] for y, r in zip(ys, held, strict=True)],
                  [r["interval"][1] - y for y, r in zip(ys, held, strict=True)]]
        ax.errorbar([r["steps"] for r in held], ys, yerr=errors, marker="s", capsize=3,
                    label="held-out success (95 % interval)")
        for r in held:
            ax.annotate(f"{r['minutes']:.0f} min", (r["steps"], r["heldout"]),
                        textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xlabel("trainer steps")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def evaluate_checkpoint(run_dir: Path, config_path: Path) -> dict[str, Any]:
    """Held-out success of the run's last checkpoint, measured as the run measures it."""
    import torch

    from codeplane.config import load_settings
    from codeplane.models.engine import Engine
    from codeplane.rl.adapter import LlamaSampler
    from codeplane.rl.config import load_config
    from codeplane.rl.index import RunIndex
    from codeplane.rl.run import env_factory, evaluate, split_tasks, start_ray

    config = load_config(config_path)
    checkpoint = run_dir / "checkpoint"
    state = torch.load(checkpoint / "trainer.pt", weights_only=True)  # data, never code
    trained = json.loads((checkpoint / "run.json").read_text())["next_step"]
    alpha = json.loads((checkpoint / "trainer.json").read_text())["lora_alpha"]
    heldout = split_tasks(config, "heldout")
    scratch = run_dir / "scratch-eval"
    scratch.mkdir(exist_ok=True)
    start_ray(config.ray.num_cpus)
    import ray

    engine = Engine(load_settings())
    index = RunIndex(config.search).open()  # the run's index: its episodes searched it
    try:
        index.index(t.snapshot for t in heldout)  # indexed by the run: nothing to embed
        sampler = LlamaSampler(engine, config.sampler.model, run_dir / "adapters-eval", alpha,
                               config.rollout.seed)
        sampler.load_weights(state["lora"], int(state["version"]))
        started = time.monotonic()
        evaluation = evaluate(sampler, heldout, config, env_factory(config, scratch),
                              int(state["version"]), index.services)
    finally:
        index.close()
        engine.close()
        ray.shutdown()
    record = {"steps": trained, "heldout_success": evaluation.success, "time": time.time(),
              "checkpoint": True, "tasks": len(heldout),
              "seconds": round(time.monotonic() - started, 1),
              "episodes": evaluation.episodes}
    with (run_dir / "heldout.jsonl").open("a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tasks", type=int, default=20, help="held-out tasks per evaluation")
    parser.add_argument("--png", type=Path, help="default: RUN_DIR/curve.png")
    parser.add_argument("--evaluate", type=Path, metavar="CONFIG",
                        help="first evaluate the last checkpoint on the held-out set")
    args = parser.parse_args()
    run_dir = args.run_dir.expanduser()
    if args.evaluate:
        print(json.dumps(evaluate_checkpoint(run_dir, args.evaluate)))
    rows = table(read_jsonl(run_dir / "steps.jsonl"), read_jsonl(run_dir / "heldout.jsonl"),
                 args.tasks)
    print_table(rows, args.tasks)
    png = args.png or run_dir / "curve.png"
    plot(rows, png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
