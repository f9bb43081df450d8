"""Issue 31's curves for several runs (seeds) in one PNG, and their per-step table.

A run's own `curves.png` shows one run's reward and held-out success; the issue asks, per
step and for at least two seeds, for success, codebase_search calls per episode, tool calls
per model turn, turns and seconds per episode. This reads each run's `steps.jsonl` (each
step's training episodes: `conduct`) and `heldout.jsonl` (each evaluation's), and draws one
panel per number, a line per run for the training episodes and squares for its held-out
evaluations. `--before DIR`: a run whose held-out evaluation at step 0 is the starting
policy's, drawn for every run (the seeds of `examples/rl/product-rl.toml` start from one
policy, evaluated once). `--after DIR ...`, one per run in the same order: a run (`init` =
that run, `steps = 0`) whose step-0 evaluation is that run's policy after its last step,
drawn there (a run stopped at a step boundary has no evaluation of its own after it).

    python bench/rl/curves.py ~/.codeplane/rl/runs/product-rl-s0 ~/.codeplane/rl/runs/product-rl-s1 \
        --before ~/.codeplane/rl/runs/product-rl-before --png docs/rl-product-rl.png \
        --after ~/.codeplane/rl/runs/product-rl-s0-final ~/.codeplane/rl/runs/product-rl-s1-final

Prints a markdown table per run (step, reward, success, searches, calls per turn, turns,
seconds, groups kept) and the held-out evaluations.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from codeplane.rl.run import conduct
from codeplane.rl.types import Episode

PANELS = [("reward", "reward (mean)"), ("success", "success (reward 1)"),
          ("searches_per_episode", "codebase_search calls / episode"),
          ("calls_per_turn", "tool calls / model turn"),
          ("turns_per_episode", "turns / episode"), ("seconds_per_episode", "seconds / episode")]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def label(run: Path) -> str:
    """The run's seed (its checkpoint's), else its directory's name."""
    state = run / "checkpoint" / "run.json"
    seed = json.loads(state.read_text()).get("seed") if state.exists() else None
    return f"seed {seed}" if seed is not None else run.name


def training(run: Path) -> list[dict[str, Any]]:
    """Per step: its episodes were sampled by the policy after `step` RL steps (synchronous
    runs; a skipped step, no group with differing rewards, leaves the policy as it was)."""
    return [{"step": r["step"], "reward": r["reward_mean"], **r.get("conduct", {}),
             "kept": r.get("trainer", {}).get("groups_kept"),
             "skipped": r.get("trainer", {}).get("skipped")} for r in lines(run / "steps.jsonl")]


def heldout(run: Path) -> list[dict[str, Any]]:
    """Per evaluation; its conduct from the episodes' records, so that evaluations written
    before runs recorded `conduct` count the same way."""
    return [{"step": r["steps"], "phase": r.get("phase", ""), "success": r["heldout_success"],
             "reward": sum(e["reward"] for e in r["episodes"]) / max(len(r["episodes"]), 1),
             **conduct([episode(e) for e in r["episodes"]])}
            for r in lines(run / "heldout.jsonl")]


def episode(record: dict[str, Any]) -> Episode:
    """A held-out record (`run.held_out_record`) as the Episode `run.conduct` reads."""
    return Episode(record["task"], "", [], record["reward"], record.get("fault"),
                   seconds=record["seconds"], info={k: record.get(k) for k in (
                       "status", "turns", "searches", "calls", "read_turn_calls")})


def table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)

    head = "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(k)) for k in keys) + " |\n"
                          for r in rows)


def plot(runs: dict[str, tuple[list, list]], before: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(10, 5.6), sharex=True)
    for (key, title), ax in zip(PANELS, axes.flat, strict=True):
        for index, (name, (train, held)) in enumerate(runs.items()):
            color = f"C{index}"
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", ms=3, color=color,
                        label=f"{name} train")
            evals = [(r["step"], r[key]) for r in before + held if r.get(key) is not None]
            if evals:
                ax.plot(*zip(*evals, strict=True), marker="s", ls="--", color=color,
                        label=f"{name} held-out")
        for r in before:
            if r.get(key) is not None:
                ax.plot([r["step"]], [r[key]], marker="s", color="black", ls="",
                        label="start, held-out")
        if key in ("reward", "success"):
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (their `out`)")
    parser.add_argument("--before", type=Path, help="a run whose step-0 evaluation is the "
                                                    "starting policy's, shared by the runs")
    parser.add_argument("--after", nargs="*", type=Path, default=[],
                        help="per run, a run whose step-0 evaluation is its last policy's")
    parser.add_argument("--png", type=Path, default=Path("curves.png"))
    args = parser.parse_args()
    if args.after and len(args.after) != len(args.runs):
        parser.error("--after takes one directory per run")
    before = [r | {"phase": "start"} for r in heldout(args.before) if r["step"] == 0
              ] if args.before else []
    runs = {}
    for run, after in itertools.zip_longest(args.runs, args.after):
        train, held = training(run.expanduser()), heldout(run.expanduser())
        last = len(train)  # the policy after the last finished step
        held += [r | {"step": last, "phase": "after"} for r in heldout(after.expanduser())
                 if r["step"] == 0] if after else []
        runs[label(run.expanduser())] = (train, held)
    for name, (train, held) in runs.items():
        print(f"\n{name}: training episodes per step\n")
        print(table(train, ["step", "reward", "success", "searches_per_episode",
                            "calls_per_turn", "calls_per_read_turn", "turns_per_episode",
                            "seconds_per_episode", "cut", "kept"]))
        print(f"{name}: held-out evaluations\n")
        print(table(before + held, ["step", "phase", "success", "reward",
                                    "searches_per_episode", "calls_per_turn",
                                    "calls_per_read_turn", "turns_per_episode",
                                    "seconds_per_episode", "cut"]))
    plot(runs, before, args.png)
    print(f"wrote {args.png} ({args.png.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
