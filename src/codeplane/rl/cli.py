"""`codeplane rl train CONFIG [--json]`: a thin layer over `rl/run.py`.

Live progress goes to stderr (a Rich progress bar with the last step's reward, samples/s and
faults), so `--json` keeps stdout to the one final object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from codeplane.clikit import ConfigOption, JsonOption, err_console, fail, print_json, settings
from codeplane.rl.commits import repo_name
from codeplane.rl.config import ConfigError, load_config
from codeplane.rl.run import TrainingRun, save_config
from codeplane.rl.types import DtypeName

rl_app = typer.Typer(help="Reinforcement learning for the coding agent (needs the [rl] extra).",
                     no_args_is_help=True)


@rl_app.command("train")
def train_cmd(
    config: Annotated[Path, typer.Argument(dir_okay=False, help="Run config (TOML); see "
                                                                "examples/rl/.")],
    seed: Annotated[int | None, typer.Option(
        help="The run's seed instead of the config's rollout seed (give each seed its "
             "own --out: a checkpoint resumes only with the seed that wrote it).")] = None,
    out: Annotated[str | None, typer.Option(
        help="The run's directory instead of the config's `out`.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Train with rollouts on Ray over sandboxed environment servers; writes steps.jsonl,
    curves.png and checkpoints under the config's `out`. A run started again resumes."""
    try:
        run_config = load_config(config)
    except ConfigError as exc:
        fail(str(exc))
    if seed is not None:
        run_config = run_config.model_copy(update={
            "rollout": run_config.rollout.model_copy(update={"seed": seed})})
    if out is not None:
        run_config = run_config.model_copy(update={"out": out})
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


@rl_app.command("record-setup")
def record_setup_cmd(
    config: Annotated[Path, typer.Argument(dir_okay=False, help="The run's config (TOML).")],
) -> None:
    """Write the run's config.json into its `out`, as `rl train` does at its start (its
    config, and the agent setup `codeplane model add --from-run` serves its checkpoint
    with): for a run started before runs wrote it."""
    try:
        path = save_config(load_config(config))
    except ConfigError as exc:
        fail(str(exc))
    err_console.print(f"wrote {path}", highlight=False)


@rl_app.command("train-next-edit")
def train_next_edit_cmd(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(dir_okay=False, help="The adapter file to write (GGUF).")],
    git: Annotated[list[str] | None, typer.Option(
        help="A repository's git directory (or work tree) to cut cases from; repeatable.")
    ] = None,
    repo: Annotated[list[str] | None, typer.Option(
        help="owner/name of a GitHub repository, cloned once into the cache; repeatable.")
    ] = None,
    run: Annotated[Path | None, typer.Option(
        file_okay=False, help="Run directory: examples, checkpoint, steps.jsonl (default: "
                              "OUT's name + .run beside it). Run again to resume.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Supervised steps in all.")] = 60,
    batch: Annotated[int, typer.Option(min=1, help="Examples per step.")] = 4,
    lr: Annotated[float, typer.Option(min=1e-8, help="Learning rate.")] = 2e-4,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 16,
    cases: Annotated[int, typer.Option(min=1, help="Replayed cases cut per repository.")] = 200,
    max_tokens: Annotated[int, typer.Option(
        min=64, help="Longest example kept (prompt and answer tokens).")] = 1536,
    model: Annotated[str, typer.Option(help="The base model the adapter is trained on.")
                     ] = "code-small",
    dtype: Annotated[DtypeName, typer.Option(
        help="The frozen base weights' precision; auto: bfloat16 where the CPU has it "
             "natively.")] = "float32",
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Train next-edit Tab's LoRA adapter: replayed commits of the repositories, the prompt
    Tab builds at serve time, supervised steps with RL's trainer; writes OUT and prints the
    `codeplane model add` line that serves it."""
    from codeplane.rl.commits import CommitsError, git_dir
    from codeplane.rl.nextedit import NextEditError, TrainSpec, check_repositories, train

    specs = [*(git or []), *(repo or [])]
    if not specs:
        fail("give at least one --git DIR or --repo owner/name")
    cfg = settings(ctx, config)
    try:
        check_repositories(specs)
        # a --git value is always a path (git_dir would read a relative "a/b" as owner/name)
        wheres = [str(Path(g).absolute()) for g in git or []] + list(repo or [])
        gits = {repo_name(s): git_dir(s, cfg.home / "cache", None) for s in wheres}
    except (NextEditError, CommitsError) as exc:
        fail(str(exc))
    spec = TrainSpec(run or out.with_name(out.name + ".run"), out, steps, batch, lr, rank,
                     2.0 * rank, cases, max_tokens, model, dtype=dtype)

    def on_step(record: dict) -> None:
        err_console.print(f"step {record['step'] + 1}/{steps} nll {record.get('nll', 0):.4f} "
                          f"({record.get('seconds', 0):.1f} s)", highlight=False)

    try:
        summary = train(spec, gits, cfg, on_step)
    except NextEditError as exc:
        fail(str(exc))
    except ImportError as exc:  # torch, peft, transformers: the [rl] extra
        fail(f"{exc.name or exc} is missing: install the RL extra, pip install -e '.[rl]'")
    line = f"codeplane model add NAME --adapter {out} --base {model}"
    if as_json:
        print_json({**summary, "register": line})
    else:
        err_console.print(f"wrote {out} ({summary['adapter_bytes']} bytes) after "
                          f"{summary['steps']} steps on {summary['examples']} examples",
                          highlight=False)
        print(line)
