"""`codeplane agent "TASK"` and `codeplane tool NAME 'JSON_ARGS'`: thin layers over the loop
and the standard toolset. Progress streams with Rich; `--json` prints only the result object.

Both hold no engine: their `code_edit` sketches are merged deterministically (a sketch that
merge declines is refused with its reasons); a server's runs merge with its apply model."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.syntax import Syntax

from codeplane.agent.env import Environment, ToolError, local_environment
from codeplane.agent.loop import Agent, Event, Transcript
from codeplane.agent.services import tool_services
from codeplane.agent.setup import Choice, resolve
from codeplane.agent.tools import default_toolset
from codeplane.agent.toolset import ToolContext
from codeplane.clikit import (
    ConfigOption,
    JsonOption,
    ServerOption,
    console,
    fail,
    print_json,
    server_url,
    settings,
)
from codeplane.core.chat import HttpChatModel, ModelError
from codeplane.sandbox import BACKENDS, SandboxUnavailable

PathOption = Annotated[Path, typer.Option("--path", help="Workspace directory (default: .).")]
NoSandbox = Annotated[bool, typer.Option(
    "--no-sandbox", help="Run commands directly on the host, without bubblewrap (unsafe).")]
Network = Annotated[bool, typer.Option(
    "--network", help="Allow network access inside the sandbox (default: none).")]
ToolsetName = Literal["full", "core"]
BackendOption = Annotated[str | None, typer.Option(
    "--backend", help=f"Workspace backend: {', '.join(BACKENDS)} (default: bwrap; "
                      "--no-sandbox means host).")]


def open_environment(path: Path, no_sandbox: bool, network: bool = False,
                     backend: str | None = None) -> Environment:
    if no_sandbox and backend not in (None, "host"):
        fail(f"--no-sandbox runs on the host; it cannot be combined with --backend {backend}")
    try:
        return local_environment(path.expanduser().resolve(), sandbox=not no_sandbox,
                                 network=network, backend=backend)
    except (SandboxUnavailable, ToolError) as exc:
        fail(f"{exc}" if isinstance(exc, ToolError) else f"refusing to run: {exc}")


def agent_cmd(
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    path: PathOption = Path("."),
    model: Annotated[str | None, typer.Option(help="Model name (default: code-medium).")] = None,
    max_steps: Annotated[int | None, typer.Option(
        help="Maximum model turns (default: the model's setup, else 25).", min=1)] = None,
    transcript: Annotated[Path | None, typer.Option(
        help="JSONL transcript file (default: $CODEPLANE_HOME/client/agent/runs/ID.jsonl).")
    ] = None,
    json_: JsonOption = False,
    server: ServerOption = None,
    base_url: Annotated[str | None, typer.Option(
        help="Any OpenAI-compatible base URL instead of the codeplane server.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="CODEPLANE_API_KEY",
                                                help="Bearer token for --base-url.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        help="Max tokens per model reply (default: the model's setup, else 1024).", min=16)
    ] = None,
    toolset: Annotated[ToolsetName | None, typer.Option(
        help="The tools offered (default: the model's setup, else full).")] = None,
    answer_turn: Annotated[bool | None, typer.Option(
        "--answer-turn/--no-answer-turn",
        help="Ask the last turn without tools (default: the model's setup, else no).")] = None,
    setup: Annotated[Choice, typer.Option(
        help="model: the agent setup a trained model was registered with (toolset, tool "
             "output limit, answer turn, hooks, limits; the product's for other models); "
             "product: the product's defaults. Options given explicitly win over either.")
    ] = "model",
    serial: Annotated[bool, typer.Option(help="Run a turn's tool calls one by one.")] = False,
    no_sandbox: NoSandbox = False,
    network: Network = False,
    backend: BackendOption = None,
    config: ConfigOption = None,
) -> None:
    """Give the coding agent a task; it reads, searches, edits and runs commands until done."""
    cfg = settings(ctx, config)
    env = open_environment(path, no_sandbox, network, backend)
    if not task.strip():
        fail("task is empty")
    name = model or cfg.agent.model
    chat = HttpChatModel(base_url or server_url(ctx, server, config) + "/v1", name, api_key)
    try:
        chosen = resolve(chat.listing().get("agent_setup"), setup, max_steps=max_steps,
                         max_tokens=max_tokens, toolset=toolset, answer_turn=answer_turn,
                         parallel=False if serial else None)
    except ModelError as exc:  # as a run that cannot reach its model ends: exit 1
        chat.close()
        env.close()
        fail(str(exc), 1)
    agent = Agent(chat, env, chosen.config, services=tool_services(cfg), hooks=chosen.hooks)
    record = Transcript(transcript or cfg.client_dir / "agent" / "runs" / f"{agent.run_id}.jsonl")
    agent.listeners.append(record)
    if not json_:
        agent.listeners.append(_show)
        if not env.workspace.sandboxed:
            console.print("[bold yellow]warning:[/] commands run unsandboxed on the host")
    previous = signal.signal(signal.SIGINT, lambda *_: _cancel(agent, previous))
    try:
        result = agent.run(task)
    finally:
        signal.signal(signal.SIGINT, previous)
        record.close()
        chat.close()
        env.close()
    result.transcript = str(record.path)
    if json_:
        print_json(result.to_dict())
    else:
        _summary(result)
    if result.status == "error":
        raise typer.Exit(1)


def _cancel(agent: Agent, previous: Any) -> None:
    """First Ctrl-C: stop after the current model reply, killing running commands; the
    second one interrupts at once."""
    agent.cancel.set()
    signal.signal(signal.SIGINT, previous)
    console.print("[yellow]cancelling after the current step (Ctrl-C again to abort)[/]")


def _show(event: Event) -> None:
    kind = event["type"]
    if kind == "model_turn":
        text = (event["message"].get("content") or "").strip()
        if text and event["message"].get("tool_calls"):
            console.print(f"[dim]{text[:500]}[/]", highlight=False)
    elif kind == "tool_start":
        args = json.dumps(event["arguments"])[:160]
        console.print(f"[cyan]→ {event['name']}[/] {args}", highlight=False)
    elif kind == "tool_result":
        _show_result(event)
    elif kind == "compaction":
        console.print(f"[dim]compacted {event['messages_compacted']} old tool results[/]")
    elif kind == "user_message":
        console.print("[dim]reminding the model to use tools[/]")


def _show_result(event: Event) -> None:
    data = event.get("data") or {}
    mark = "[green]✓[/]" if event["ok"] else "[red]✗[/]"
    first = event["output"].splitlines()[0] if event["output"] else ""
    console.print(f"  {mark} {first[:200]} [dim]({event['seconds']:.2f}s)[/]", highlight=False)
    if data.get("diff"):
        console.print(Syntax(data["diff"].rstrip()[:4000], "diff", theme="ansi_dark"))
    if data.get("todos"):
        marks = {"pending": "☐", "in_progress": "◐", "completed": "☑", "cancelled": "☒"}
        for todo in data["todos"]:
            console.print(f"    {marks[todo['status']]} {todo['content']}", highlight=False)
    if "exit_code" in data:
        tail = event["output"].splitlines()[1:-1][-8:]
        for line in tail:
            console.print(f"    [dim]{line[:200]}[/]", highlight=False)


def _summary(result: Any) -> None:
    color = "green" if result.status == "completed" else "yellow"
    if result.status == "error":
        color = "red"
    console.print(f"\n[bold {color}]{result.status}[/] in {result.steps} steps, "
                  f"{result.tool_calls} tool calls, {result.prompt_tokens}+"
                  f"{result.completion_tokens} tokens, {result.seconds:.1f}s "
                  f"({result.model})", highlight=False)
    if result.error:
        console.print(f"[red]{result.error}[/]", highlight=False)
    if result.answer:
        console.print(result.answer, highlight=False)
    console.print(f"[dim]transcript: {result.transcript}[/]", highlight=False)


def tool_cmd(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="Tool name; omit to list the tools.")] = None,
    args: Annotated[str, typer.Argument(help="Arguments as a JSON object.")] = "{}",
    path: PathOption = Path("."),
    json_: JsonOption = False,
    no_sandbox: NoSandbox = False,
    network: Network = False,
    backend: BackendOption = None,
    config: ConfigOption = None,
) -> None:
    """Execute one agent tool exactly as the agent would (for debugging and environments)."""
    toolset = default_toolset()
    if name is None:
        if json_:
            print_json(toolset.schemas())
        for spec in [] if json_ else toolset.tools.values():
            console.print(f"[cyan]{spec.name}[/]({', '.join(spec.properties)}): "
                          f"{spec.description}", highlight=False)
        return
    if name not in toolset:
        fail(f"unknown tool {name!r}; available: {', '.join(toolset.tools)}")
    try:
        parsed = json.loads(args)
    except ValueError as exc:
        fail(f"arguments are not valid JSON: {exc}")
    if not isinstance(parsed, dict):
        fail("arguments must be a JSON object, e.g. '{\"path\": \"README.md\"}'")
    env = open_environment(path, no_sandbox, network, backend)
    try:
        context = ToolContext(services=tool_services(settings(ctx, config)))
        result = toolset.execute(env, name, parsed, context)
    finally:
        env.close()
    if json_:
        print_json(result.to_dict())
    else:
        typer.echo(result.output)
    raise typer.Exit(0 if result.ok else 1)

