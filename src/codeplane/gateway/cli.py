"""`codeplane keys ...` (server-issued API keys) and `codeplane gateway status`."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from codeplane.clikit import (
    ApiKeyOption,
    ConfigOption,
    JsonOption,
    ServerApi,
    ServerOption,
    console,
    fail,
    print_json,
    settings,
)
from codeplane.config.gateway import PRIORITIES
from codeplane.gateway.keys import KeyStore

keys_app = typer.Typer(help="Issue, list and revoke the server's API keys.",
                       no_args_is_help=True)
gateway_app = typer.Typer(help="Inspect the model gateway.", no_args_is_help=True)


@keys_app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Who or what uses the key.")],
    tenant: Annotated[str | None, typer.Option(
        help="Tenant the key belongs to: keys of one tenant see the same workspaces and "
             "agent runs. Default: the key's name (a tenant of its own).")] = None,
    rpm: Annotated[int | None, typer.Option(min=1, help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(min=1, help="Tokens per minute.")] = None,
    budget_tokens: Annotated[int | None, typer.Option(
        min=1, help="Total tokens the key may ever use.")] = None,
    priority: Annotated[str, typer.Option(
        help=f"Highest class the key may use: {', '.join(PRIORITIES)}.")] = "agent",
    json_: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Create a key. It is printed once; the server stores only its hash."""
    store = KeyStore.from_settings(settings(ctx, config))
    try:
        key, secret = store.create(name, rpm, tpm, budget_tokens, priority, tenant)
    except ValueError as exc:
        fail(str(exc))
    if json_:
        print_json({"id": key.id, "name": key.name, "tenant": key.tenant, "key": secret})
        return
    console.print(f"[green]✓[/] key {key.name} ({key.id}, tenant {key.tenant}) - shown once, "
                  "store it now:")
    console.print(secret, highlight=False, soft_wrap=True)


@keys_app.command("list")
def list_(ctx: typer.Context, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """List keys (hint, limits, tokens used); never the keys themselves."""
    store = KeyStore.from_settings(settings(ctx, config))
    rows = [{"id": k.id, "name": k.name, "tenant": k.tenant, "hint": k.hint + "...",
             "priority": k.priority,
             "rpm": k.rpm, "tpm": k.tpm, "budget_tokens": k.budget_tokens,
             "used_tokens": store.used(k), "revoked": k.revoked,
             "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created))}
            for k in store.all()]
    if json_:
        print_json(rows)
        return
    table = Table(*rows[0].keys()) if rows else Table("no keys yet")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row.values()))
    console.print(table)


@keys_app.command("revoke")
def revoke(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Key name or id.")],
           config: ConfigOption = None) -> None:
    """Revoke a key; a running server refuses it within a second."""
    try:
        key = KeyStore.from_settings(settings(ctx, config)).revoke(name)
    except KeyError:
        fail(f"no active key named {name!r}")
    console.print(f"revoked {key.name} ({key.id})")


@gateway_app.command("status")
def status(
    ctx: typer.Context,
    server: ServerOption = None,
    api_key: ApiKeyOption = None,
    json_: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Deployments' health: circuit state, cooldown, slow-start ramp, load, latency."""
    data = ServerApi(ctx, server, api_key, config, "/v1/gateway").call("GET", "/status",
                                                                  timeout=10).json()
    if json_:
        print_json(data)
        return
    table = Table("model", "deployment", "upstream", "state", "cooldown s", "ramp",
                  "in flight", "latency ms", "last error")
    for model in data["models"]:
        for d in model["deployments"]:
            style = {"open": "red", "half_open": "yellow"}.get(d["state"], "green")
            table.add_row(model["name"], d["id"], d["upstream"], f"[{style}]{d['state']}[/]",
                          str(d["cooldown_s"]), str(d["ramp"]), str(d["outstanding"]),
                          str(d["latency_ms"] or "-"), d["last_error"][:60])
    console.print(table)
