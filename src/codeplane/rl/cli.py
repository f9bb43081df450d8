"""`codeplane rl train CONFIG [--json]`: a thin layer over `rl/run.py`.

Live progress goes to stderr (a Rich progress bar with the last step's reward, samples/s and
faults), so `--json` keeps stdout to the one final object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from codeplane.clikit import JsonOption, err_console, fail, print_json
from codeplane.rl.config import ConfigError, load_config
from codeplane.rl.run import TrainingRun

rl_app = typer.Typer(help="Reinforcement learning for the coding agent (needs the [rl] extra).",
                     no_args_is_help=True)


@rl_app.command("train")
def train_cmd(
    config: Annotated[Path, typer.Argument(dir_okay=False, help="Run config (TOML); see "
                                                                "examples/rl/.")],
    as_json: JsonOption = False,
) -> None:
    """Train with rollouts on Ray over sandboxed environment servers; writes steps.jsonl,
    curves.png and checkpoints under the config's `out`. A run started again resumes."""
    try:
        run_config = load_config(config)
    except ConfigError as exc:
        fail(str(exc))
    with Progress(TextColumn("[bold]rl train"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                  console=err_console, transient=as_json) as bar:
        task = bar.add_task("steps", total=run_config.steps, status="rolling out ...")

        def on_step(record: dict) -> None:
            reward = record["reward_mean"]
            status = (f"reward {reward:.2f}" if reward is not None else "reward -") + (
                f" | {record['samples_per_second']:.2f} samples/s"
                f" | faults {sum(record['faults'].values())}")
            bar.update(task, completed=record["step"] + 1, status=status)

        try:
            summary = TrainingRun(run_config, on_step).train()
        except ConfigError as exc:
            fail(str(exc))
        except ImportError as exc:  # ray, torch or matplotlib: the [rl] extra
            fail(f"{exc.name or exc} is missing: install the RL extra, pip install -e '.[rl]'")
    if as_json:
        print_json(summary)
    else:
        for key, value in summary.items():
            err_console.print(f"{key}: {value}", highlight=False)
