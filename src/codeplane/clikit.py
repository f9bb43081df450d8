"""Shared pieces of every CLI command: options, settings loading, output and errors.

Compartment CLIs (`<compartment>/cli.py`) build on these so flags and failure messages look
the same everywhere. Errors go to stderr with exit code 2 and never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from codeplane.config import ConfigError, Settings, load_settings

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
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def settings(config: Path | None = None, **overrides: Any) -> Settings:
    try:
        return load_settings(config, **overrides)
    except ConfigError as exc:
        fail(str(exc))


def server_url(server: str | None, config: Path | None = None) -> str:
    return (server or settings(config).server).rstrip("/")


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")
