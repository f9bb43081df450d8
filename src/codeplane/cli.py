"""The `codeplane` command. Each compartment owns its sub-commands; this file only mounts them."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from codeplane import __version__
from codeplane.agent.cli import agent_cmd, tool_cmd
from codeplane.apply.cli import apply_command
from codeplane.background.cli import agents_app
from codeplane.clikit import (
    ConfigOption,
    JsonOption,
    Program,
    console,
    err_console,
    fail,
    print_json,
    settings,
)
from codeplane.config import ConfigError
from codeplane.config.gateway import ProviderTable
from codeplane.events.cli import events_app
from codeplane.gateway.cli import gateway_app, keys_app
from codeplane.gateway.providers.table import PROVIDERS
from codeplane.indexing import cli as index_cli
from codeplane.models.cli import app as model_app
from codeplane.rl.cli import rl_app
from codeplane.storage.cli import db_app
from codeplane.tab import cli as tab_cli


def _version(value: bool) -> None:
    if value:
        typer.echo(f"codeplane {__version__}")
        raise typer.Exit()


def build_app(providers: ProviderTable) -> typer.Typer:
    """The `codeplane` command over a provider table: its root hands the table to every
    command as Typer's context object (`clikit.Program`; settings load sits below the
    gateway, so it cannot import the table), so that `[[models]]` is checked by it."""
    app = typer.Typer(
        help="codeplane: self-hostable backend for AI-assisted coding (local models, search, "
        "agent, Tab, apply).",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    for name, sub_app in SUB_APPS.items():
        app.add_typer(sub_app, name=name)
    for name, command in COMMANDS.items():
        app.command(name)(command)

    @app.callback()
    def root(
        ctx: typer.Context,
        version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                              help="Print the version and exit.")] = False,
    ) -> None:
        """Settings come from $CODEPLANE_HOME/codeplane.toml and CODEPLANE_* variables."""
        ctx.obj = Program(providers)

    return app


def serve(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8300).", min=1, max=65535)] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    workers: Annotated[int | None, typer.Option(
        help="Server processes sharing the port (default 1; see docs/gateway.md).",
        min=1, max=64)] = None,
    config: ConfigOption = None,
) -> None:
    """Run the HTTP server (OpenAI-compatible API plus every compartment's endpoints).

    Any address other than loopback needs an API key first (`codeplane keys create NAME
    --tenant T`): without one the server refuses to start."""
    from codeplane.models.engine import Engine
    from codeplane.tab import preload

    cfg = settings(ctx, config)
    processes = workers or cfg.serve.workers
    engine = Engine(cfg) if processes == 1 and preload.preloaded(cfg) else None
    if engine is not None:  # the Tab model loads while the server's modules import
        preload.start(cfg, engine)
    from codeplane.server.app import serve as run

    try:
        run(cfg, host or cfg.serve.host, port or cfg.serve.port, log_level, processes, engine)
    except ConfigError as exc:  # bad router.fallbacks/[storage]/embedder, or an unsafe bind
        fail(str(exc))
    finally:
        if engine is not None:
            engine.close()


def doctor(ctx: typer.Context, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """Check what this machine can run: CPU and llama.cpp build, a one-token decode by every
    installed model (in a child process), sandbox backends, cgroups, configured storage.

    Exit status 1 when something the settings need is broken; warnings do not count."""
    from dataclasses import asdict

    from codeplane.doctor import run_checks

    checks = run_checks(settings(ctx, config))
    failed = any(c.status == "fail" for c in checks)
    if json_:
        print_json({"ok": not failed, "checks": [asdict(c) for c in checks]})
    else:
        for c in checks:
            mark = {"ok": "[green]ok  [/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
            console.print(f"{mark[c.status]} {c.name:<18} {escape(c.detail)}", soft_wrap=True)
            if c.fix and c.status != "ok":
                console.print(f"     {'':<18} fix: {escape(c.fix)}", soft_wrap=True)
    if failed:
        raise typer.Exit(1)


def quickstart(
    ctx: typer.Context,
    tab_model: Annotated[str, typer.Option(help="Model for Tab and apply.")] = "code-small",
    agent_model: Annotated[str, typer.Option(help="Model for the agent.")] = "code-medium",
    agent_steps: Annotated[int, typer.Option(help="The agent's maximum model turns.",
                                             min=1, max=50)] = 8,
    config: ConfigOption = None,
) -> None:
    """Pull the built-in models, start a server and show codeplane on a sample project it
    writes: private index and search, the agent fixing a failing test in a sandbox, apply,
    Tab. Exit status 1 when a step failed."""
    from codeplane.quickstart import run

    run(settings(ctx, config), tab_model, agent_model, agent_steps)


SUB_APPS = {"model": model_app, "keys": keys_app, "gateway": gateway_app, "events": events_app,
            "agents": agents_app, "rl": rl_app, "db": db_app}
COMMANDS = {"index": index_cli.index_cmd, "search": index_cli.search_cmd, "agent": agent_cmd,
            "tool": tool_cmd, "complete": tab_cli.complete, "lsp": tab_cli.lsp,
            "tab-feedback": tab_cli.tab_feedback, "apply": apply_command, "serve": serve,
            "doctor": doctor, "quickstart": quickstart}
app = build_app(PROVIDERS)  # the program's composition root: the product's provider table


def main() -> None:
    """Entry point; a broken settings or registry file found late still gets a one-line error."""
    try:
        app()
    except ConfigError as exc:  # outside Typer's context, so no `fail()` here
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
