"""`codeplane agents`: launch background agents on a codeplane server and follow them:
`launch`, `list`, `show`, `logs [--follow]`, `cancel`, `delete`, `pull` (the run's patch applied to a
local checkout with `git am --3way`; on a conflict nothing is left half-applied, exit 2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from codeplane.clikit import (
    ApiKeyOption,
    ConfigOption,
    JsonOption,
    ServerApi,
    ServerOption,
    console,
    error_message,
    fail,
    print_json,
)

agents_app = typer.Typer(help="Background agents on a codeplane server: launch, watch, pull.",
                         no_args_is_help=True)
RunId = Annotated[str, typer.Argument(help="Run id (from `agents launch` or `agents list`).")]


class Api(ServerApi):
    """The server's background-agents API."""

    def __init__(self, ctx: typer.Context, server: str | None, api_key: str | None,
                 config: Path | None) -> None:
        super().__init__(ctx, server, api_key, config, "/v1/background-agents")

    def events(self, run_id: str, follow: bool):
        """The run's events so far (and, with `follow`, until it ends)."""
        if not follow:
            run = self.call("GET", f"/{run_id}").json()
            if run["status"] in ("queued", "running"):
                fail("the run is still going: use --follow to watch it to the end")
        try:
            with self.http.stream("GET", f"{self.base}/{run_id}/events", timeout=None) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    fail(error_message(resp))
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except httpx.TransportError as exc:
            fail(f"lost the connection to the server ({exc})")


@agents_app.command("launch")
def launch(
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="What the agent should do.")],
    repo: Annotated[str, typer.Option(help="Git repository: a path (or .bundle file) on the "
                                           "server machine under its workspace roots, or a "
                                           "URL its serve.repo_urls allows.")],
    ref: Annotated[str, typer.Option(help="Branch, tag or commit to start from.")] = "HEAD",
    model: Annotated[str, typer.Option(help="Model name.")] = "code-medium",
    max_steps: Annotated[int, typer.Option(help="Maximum model turns.", min=1)] = 25,
    json_: JsonOption = False, server: ServerOption = None, api_key: ApiKeyOption = None,
    config: ConfigOption = None,
) -> None:
    """Start a background agent; prints its id at once (the run goes on on the server)."""
    path = Path(repo)
    body = {"repo": str(path.resolve()) if path.exists() else repo, "ref": ref, "task": task,
            "model": model, "max_steps": max_steps}
    run = Api(ctx, server, api_key, config).call("POST", json=body).json()
    if json_:
        print_json(run)
    else:
        typer.echo(run["id"])


@agents_app.command("list")
def list_runs(ctx: typer.Context, json_: JsonOption = False, server: ServerOption = None,
              api_key: ApiKeyOption = None, config: ConfigOption = None) -> None:
    """Your background agents, newest first."""
    runs = Api(ctx, server, api_key, config).call("GET").json()["data"]
    if json_:
        print_json(runs)
        return
    for run in runs:
        console.print(f"{run['id']}  {run['status']:<11} {run['task'][:70]}", highlight=False)


@agents_app.command("show")
def show(ctx: typer.Context, run_id: RunId, json_: JsonOption = False, server: ServerOption = None,
         api_key: ApiKeyOption = None, config: ConfigOption = None) -> None:
    """One run: status, repo, branch, commit."""
    run = Api(ctx, server, api_key, config).call("GET", f"/{run_id}").json()
    if json_:
        print_json(run)
        return
    for key in ("id", "status", "repo", "ref", "task", "model", "branch", "commit_sha",
                "error"):
        console.print(f"{key:<10} {run.get(key)}", highlight=False)


@agents_app.command("logs")
def logs(ctx: typer.Context, run_id: RunId,
         follow: Annotated[bool, typer.Option("--follow", "-f",
                                              help="Keep watching until the run ends.")] = False,
         json_: JsonOption = False, server: ServerOption = None, api_key: ApiKeyOption = None,
         config: ConfigOption = None) -> None:
    """The run's events: tool calls, their output, diffs, the result."""
    for event in Api(ctx, server, api_key, config).events(run_id, follow):
        if json_:
            typer.echo(json.dumps(event))
        else:
            console.print(describe(event), highlight=False, markup=False)


def describe(event: dict[str, Any]) -> str:
    """One line (or block) per event for a terminal."""
    kind = event["type"]
    if kind == "tool_start":
        return f"> {event.get('name')} {json.dumps(event.get('arguments'))[:200]}"
    if kind == "tool_result":
        return f"  {str(event.get('output', ''))[:400]}"
    if kind == "model_turn":
        return f"model: {(event.get('message') or {}).get('content') or ''}"[:400]
    if kind == "diff":
        return event["diff"]
    if kind in ("end", "interrupted"):
        return f"[{kind}] {event.get('status', '')} {event.get('error') or ''}".strip()
    if kind == "result":
        return f"result: branch {event['branch']} commit {event['commit']}"
    return f"[{kind}]"


@agents_app.command("cancel")
def cancel(ctx: typer.Context, run_id: RunId, server: ServerOption = None,
           api_key: ApiKeyOption = None, config: ConfigOption = None) -> None:
    """Stop a running agent (what it changed so far is still committed)."""
    got = Api(ctx, server, api_key, config).call("POST", f"/{run_id}/cancel").json()
    typer.echo("cancel requested" if got["cancel_requested"] else "the run is not running")


@agents_app.command("delete")
def delete(ctx: typer.Context, run_id: RunId, server: ServerOption = None,
           api_key: ApiKeyOption = None, config: ConfigOption = None) -> None:
    """Erase a finished run on the server: record, events, patch and checkout."""
    Api(ctx, server, api_key, config).call("DELETE", f"/{run_id}")
    typer.echo(f"deleted {run_id}")


@agents_app.command("pull")
def pull(ctx: typer.Context, run_id: RunId,
         path: Annotated[Path, typer.Option("--path", help="Local checkout (default: .).")]
         = Path("."),
         server: ServerOption = None, api_key: ApiKeyOption = None,
         config: ConfigOption = None) -> None:
    """Apply the run's patch to a local checkout as commits (`git am --3way`). On a
    conflict the checkout is left as it was and the command exits 2."""
    api = Api(ctx, server, api_key, config)
    run = api.call("GET", f"/{run_id}").json()
    if run["status"] in ("queued", "running"):
        fail("the run is still going; pull it once it has ended")
    patch = api.call("GET", f"/{run_id}/patch").text
    if not patch.strip():
        fail(f"run {run_id} changed nothing: there is no patch to pull")
    git = ["git", "-C", str(path), *committer_fallback(path)]  # --abort records one too
    am = subprocess.run([*git, "am", "--3way", "--quiet"], input=patch, capture_output=True,
                        text=True, check=False)
    if am.returncode != 0:
        subprocess.run([*git, "am", "--abort"], capture_output=True, check=False)
        detail = (am.stderr or am.stdout).strip().splitlines()
        fail(f"the patch of run {run_id} does not apply cleanly to {path.resolve()}; nothing "
             f"was changed. git said: {' / '.join(detail[:6])}")
    typer.echo(f"applied run {run_id} to {path.resolve()}")


# Who `git am` records as committer where git knows nobody (a fresh machine, a container):
# without it git refuses to commit. The patch's own author is kept either way.
FALLBACK_COMMITTER = ("-c", "user.name=codeplane", "-c", "user.email=codeplane@localhost")


def committer_fallback(path: Path) -> tuple[str, ...]:
    """Options naming codeplane as committer, only when git has no identity for `path`
    (`git var` resolves it as `git am` would: config, GIT_COMMITTER_*, EMAIL)."""
    known = subprocess.run(["git", "-C", str(path), "var", "GIT_COMMITTER_IDENT"],
                           capture_output=True, check=False)
    return () if known.returncode == 0 else FALLBACK_COMMITTER
