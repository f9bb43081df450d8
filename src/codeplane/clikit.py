"""Shared pieces of every CLI command: options, settings loading, output and errors.

Compartment CLIs (`<compartment>/cli.py`) build on these so flags and failure messages look
the same everywhere. Errors go to stderr with exit code 2 and never a traceback.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from codeplane.config import ConfigError, Settings, load_settings
from codeplane.config.gateway import ProviderTable
from codeplane.core.http import api_client

console = Console()
err_console = Console(stderr=True)

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", dir_okay=False,
                  help="Settings file (default: $CODEPLANE_HOME/codeplane.toml)."),
]
ServerOption = Annotated[
    str | None, typer.Option("--server", envvar="CODEPLANE_SERVER",
                             help="codeplane server URL (default http://127.0.0.1:8300).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
ApiKeyOption = Annotated[
    str | None, typer.Option("--api-key", envvar="CODEPLANE_API_KEY",
                             help="API key, for a server that requires one (default: "
                                  "$CODEPLANE_API_KEY).")]


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `message` as it is (escaped: a settings error names `[tab]`, which rich would
    read as markup and drop) and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@dataclass(frozen=True)
class Program:
    """What a program's root command hands its commands as Typer's context object
    (`ctx.obj`): the gateway's provider table (this module sits below the gateway), so that
    every command checks `[[models]]` when it loads settings. It lives in the invocation, not
    in this module, so two programs in one process never see each other's table, and a
    sub-app a test invokes on its own loads settings unchecked, as a script does."""

    providers: ProviderTable


def settings(ctx: typer.Context, config: Path | None = None, **overrides: Any) -> Settings:
    program = ctx.find_object(Program)
    try:
        return load_settings(config, providers=program.providers if program else None,
                             **overrides)
    except ConfigError as exc:
        fail(str(exc))


def server_url(ctx: typer.Context, server: str | None, config: Path | None = None) -> str:
    return (server or settings(ctx, config).server).rstrip("/")


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


class ServerApi:
    """One API of the codeplane server, as a command calls it: with the caller's key, and any
    error (no server, a 4xx or 5xx) a one-line failure that says why."""

    def __init__(self, ctx: typer.Context, server: str | None, api_key: str | None,
                 config: Path | None, prefix: str) -> None:
        self.base = server_url(ctx, server, config) + prefix
        self.http = api_client(api_key)

    def call(self, method: str, path: str = "", **kwargs: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, self.base + path, **kwargs)
        except httpx.TransportError as exc:
            fail(f"cannot reach the codeplane server at {self.base} ({exc}); start "
                 "it with `codeplane serve` or pass --server")
        if resp.status_code >= 400:
            fail(error_message(resp))
        return resp


def error_message(resp: httpx.Response) -> str:
    """The status and the message of the server's error envelope (its text if it sent none)."""
    try:
        return f"{resp.status_code}: {resp.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code}: {resp.text[:300]}"
