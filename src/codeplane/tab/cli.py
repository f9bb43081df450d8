"""`codeplane complete` (one Tab suggestion, for scripts and tests), `codeplane tab-feedback`
(accepted/rejected, for such scripts) and `codeplane lsp`."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from codeplane.clikit import (
    ApiKeyOption,
    ConfigOption,
    JsonOption,
    ServerOption,
    fail,
    print_json,
    server_url,
    settings,
)
from codeplane.tab.client import TabClientError, check_transport
from codeplane.tab.client import complete as request_completion
from codeplane.tab.client import feedback as send_feedback
from codeplane.tab.context import Budget, build_request, offset_of


class Outcome(StrEnum):
    accepted = "accepted"
    rejected = "rejected"


def complete(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Source file to complete in.")],
    line: Annotated[int, typer.Option("--line", "-l", help="Cursor line (1-based).", min=1)],
    col: Annotated[int, typer.Option("--col", "-c", help="Cursor column (1-based; the "
                                     "cursor sits before this character).", min=1)],
    model: Annotated[str | None, typer.Option(help="Model (default: the tab.model setting).")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, max=512)] = None,
    min_confidence: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="Hide suggestions less likely than this (0 shows all).")] = None,
    json_: JsonOption = False,
    api_key: ApiKeyOption = None,
    server: ServerOption = None,
    config: ConfigOption = None,
) -> None:
    """Print the Tab suggestion at FILE:LINE:COL (asks a running `codeplane serve`)."""
    if not file.is_file():
        fail(f"no such file: {file}")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {file}: {exc}")
    lines = text.split("\n")
    if line > len(lines):
        fail(f"--line {line} is past the end of {file} ({len(lines)} lines)")
    if col > len(lines[line - 1]) + 1:
        fail(f"--col {col} is past the end of line {line} ({len(lines[line - 1])} characters; "
             f"use {len(lines[line - 1]) + 1} for the end of the line)")
    body = build_request(file.name, text, offset_of(text, line - 1, col - 1), None, Budget(),
                         cursor_id="cli")
    body.update({k: v for k, v in (("model", model), ("max_tokens", max_tokens),
                                   ("min_confidence", min_confidence)) if v is not None})
    try:
        result = request_completion(server_url(ctx, server, config), body, api_key)
    except TabClientError as exc:
        fail(str(exc))
    if json_:
        print_json(result)
    elif result["text"]:
        sys.stdout.write(result["text"] + "\n")


def tab_feedback(
    ctx: typer.Context,
    suggestion_id: Annotated[str, typer.Argument(help="The `id` `codeplane complete --json` "
                                                      "printed.")],
    outcome: Annotated[Outcome, typer.Argument(help="What the user did with it.")],
    shown_ms: Annotated[float, typer.Option(min=0, max=86_400_000,
                                            help="How long it was on screen.")] = 0.0,
    json_: JsonOption = False,
    api_key: ApiKeyOption = None,
    server: ServerOption = None,
    config: ConfigOption = None,
) -> None:
    """Report a shown Tab suggestion as accepted or rejected (the server's accept rate)."""
    try:
        result = send_feedback(server_url(ctx, server, config), suggestion_id, outcome.value,
                               shown_ms, api_key)
    except TabClientError as exc:
        fail(str(exc))
    if json_:
        print_json(result)
    else:
        sys.stdout.write(f"{suggestion_id}: {outcome.value}\n")


def lsp(
    ctx: typer.Context,
    debounce_ms: Annotated[int, typer.Option(
        min=0, max=2000, help="Wait this long after a keystroke before asking the model "
                              "(cache and typed-ahead answers are never delayed).")] = 120,
    min_confidence: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="Hide suggestions less likely than this (default: the "
                               "server's tab.min_confidence).")] = None,
    telemetry: Annotated[bool, typer.Option(
        help="Log shown/accepted/rejected events to $CODEPLANE_HOME/client/tab/.")] = True,
    workspace_context: Annotated[bool, typer.Option(
        help="Send definitions of names near the cursor, found in the workspace's files, "
             "as context (off by default: no accuracy gain measured yet, docs/tab.md).")
    ] = False,
    prefill: Annotated[bool, typer.Option(
        help="Have the server evaluate a document's prompt when it is opened and when "
             "typing pauses, so its first suggestion is fast (POST /v1/tab/prefill).")] = True,
    prefill_idle_ms: Annotated[int, typer.Option(
        min=0, max=10_000, help="The pause (no edits in the document) before a prefill.")
    ] = 500,
    api_key: ApiKeyOption = None,
    server: ServerOption = None,
    config: ConfigOption = None,
) -> None:
    """Run the Tab language server on stdio (inline completion + completion fallback)."""
    from codeplane.tab.lsp import create_server
    from codeplane.tab.telemetry import Telemetry, default_path

    cfg = settings(ctx, config)
    try:
        url = check_transport(server_url(ctx, server, config))
    except TabClientError as exc:
        fail(str(exc))
    log = Telemetry(default_path(cfg.client_dir) if telemetry else None)
    create_server(url, log, debounce_ms, min_confidence, workspace_context, api_key,
                  prefill_idle_ms if prefill else None).start_io()
