"""`codeplane index` and `codeplane search`: thin layers over `indexing.sync` and `indexing.query`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from codeplane.clikit import (
    ApiKeyOption,
    ConfigOption,
    JsonOption,
    ServerOption,
    console,
    err_console,
    fail,
    print_json,
    settings,
)
from codeplane.config import Settings
from codeplane.core.http import api_client
from codeplane.indexing.query import IndexUnavailable, search
from codeplane.indexing.remote import RemoteError
from codeplane.indexing.state import workspace_dir
from codeplane.indexing.sync import SyncReport, forget, sync
from codeplane.indexing.vectors import MODES, EmbedModeError
from codeplane.indexing.workspace_keys import KeyFileError
from codeplane.models.embed import EmbedderUnavailable
from codeplane.models.embedders import Embedders


def _settings(ctx: typer.Context, config: Path | None, server: str | None) -> Settings:
    return settings(ctx, config, server=server) if server else settings(ctx, config)


def index_cmd(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(help="Workspace root (default: current dir).",
                                              file_okay=False)] = Path("."),
    watch: Annotated[bool, typer.Option(
        "--watch", help="Keep running: re-sync on file changes and every --interval.")] = False,
    interval: Annotated[float | None, typer.Option(
        help="Seconds between periodic syncs with --watch (default: indexing.sync_interval).",
        min=1)] = None,
    forget_: Annotated[bool, typer.Option(
        "--forget", help="Delete this workspace's index, on the server and on this machine, "
                         "instead of syncing it (frees its place in the server's "
                         "per-tenant workspace limit).")] = False,
    embed: Annotated[str | None, typer.Option(
        help="Where chunks are embedded: 'server' (text is sent) or 'client' (only rotated "
             "vectors leave this machine). Default: indexing.embed, else server.")] = None,
    json_: JsonOption = False,
    server: ServerOption = None,
    api_key: ApiKeyOption = None,
    config: ConfigOption = None,
) -> None:
    """Index a workspace privately: only encrypted paths, line ranges and rotated vectors are
    stored on the server; files with secrets never leave this machine."""
    if forget_:  # the directory itself may be gone already
        _forget(directory.resolve(), _settings(ctx, config, server), api_key)
        return
    if not directory.is_dir():
        fail(f"not a directory: {directory}")
    if embed not in (None, *MODES):
        fail(f"--embed must be one of {', '.join(MODES)}, not {embed!r}")
    cfg = _settings(ctx, config, server)
    if embed:
        cfg = cfg.model_copy(update={"indexing": cfg.indexing.model_copy(update={"embed": embed})})
    root = directory.resolve()
    embedders = _embedders(cfg)
    _run_once(root, cfg, json_, api_key, embedders)
    if not watch:
        return
    import watchfiles

    every = interval or cfg.indexing.sync_interval
    state_dir = cfg.client_dir.resolve()
    try:
        for _ in watchfiles.watch(root, rust_timeout=int(every * 1000), yield_on_timeout=True,
                                  watch_filter=lambda _, p: not Path(p).is_relative_to(state_dir)
                                  and "/.git/" not in p):
            _run_once(root, cfg, json_, api_key, embedders)
    except KeyboardInterrupt:
        return


def _forget(root: Path, cfg: Settings, api_key: str | None) -> None:
    try:
        dropped = forget(root, cfg, http=api_client(api_key, timeout=300))
    except (RemoteError, KeyFileError) as exc:
        fail(str(exc))
    console.print(f"[green]✓[/] {root}: index deleted" if dropped
                  else f"{root}: not indexed on this machine", highlight=False)


def _embedders(cfg: Settings) -> Embedders:
    """This process's embedders (loaded only if it embeds: `embed = "client"`)."""
    try:
        return Embedders(cfg.indexing.embedder)
    except EmbedderUnavailable as exc:
        fail(str(exc))


def _run_once(root: Path, cfg: Settings, as_json: bool, api_key: str | None,
              embedders: Embedders) -> SyncReport:
    http = api_client(api_key, timeout=300)  # closed by the sync
    try:
        if as_json:
            report = sync(root, cfg, http=http, embedders=embedders)
        else:
            report = _with_bar(root, cfg, http, embedders)
    except (RemoteError, KeyFileError, EmbedModeError, EmbedderUnavailable) as exc:
        fail(str(exc))
    if as_json:
        print_json(report.as_dict())
    else:
        _print_report(report)
    return report


def _with_bar(root: Path, cfg: Settings, http, embedders: Embedders) -> SyncReport:
    columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("chunks"),
               TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("index", total=None)
        return sync(root, cfg, progress=lambda done, total: bar.update(task, completed=done,
                                                                       total=total),
                    http=http, embedders=embedders)


def _print_report(r: SyncReport) -> None:
    secrets = ""
    if r.chunks_withheld_secrets:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(r.secret_types.items()))
        secrets = f"; [yellow]{r.chunks_withheld_secrets} chunks withheld (secrets: {kinds})[/]"
    console.print(
        f"[green]✓[/] {r.root}: {r.files_scanned} files ({r.files_changed} changed, "
        f"{r.files_deleted} deleted, {r.files_ignored} ignored, {r.files_skipped} skipped); "
        f"{r.chunks_embedded} chunks embedded, {r.chunks_reused} reused{secrets}; "
        f"{r.seconds:.2f} s", highlight=False)


def search_cmd(
    ctx: typer.Context,
    query: Annotated[str, typer.Argument(help="What to look for, in words or identifiers.")],
    path: Annotated[str | None, typer.Option(
        help="Only results under this directory (a workspace or a folder inside one).")] = None,
    limit: Annotated[int, typer.Option(help="Number of results.", min=1, max=100)] = 10,
    files: Annotated[bool, typer.Option(
        "--files", help="Rank files, not snippets: where would this change go? "
        "Documentation ranks below code that matches as well.")] = False,
    code: Annotated[bool, typer.Option(
        "--code", help="Only source files (no changelog, README or config).")] = False,
    root: Annotated[Path | None, typer.Option(
        help="Workspace root (default: the indexed workspace containing --path, else the "
             "current dir).", file_okay=False)] = None,
    json_: JsonOption = False,
    server: ServerOption = None,
    api_key: ApiKeyOption = None,
    config: ConfigOption = None,
) -> None:
    """Hybrid search (meaning and words) over an indexed workspace; snippets are read from
    local files."""
    cfg = _settings(ctx, config, server)
    workspace = (root or _find_root(_start_dir(path), cfg)).resolve()
    try:
        outcome = search(workspace, query, limit, cfg, path, http=api_client(api_key),
                         files=files, code=code, embedders=_embedders(cfg))
    except (IndexUnavailable, EmbedderUnavailable) as exc:
        fail(str(exc))
    if json_:
        print_json([{k: r[k] for k in ("path", "start_line", "end_line", "score")}
                    for r in outcome.results])
        for note in outcome.notes:
            err_console.print(f"note: {note}", highlight=False)
        return
    for note in outcome.notes:
        console.print(f"[yellow]{note}[/]", highlight=False)
    if not outcome.results:
        console.print("no results")
    for r in outcome.results:
        console.print(f"[bold cyan]{r['path']}[/]:{r['start_line']}-{r['end_line']} "
                      f"[dim]({r['score']:.3f})[/]", highlight=False)
        snippet = r["snippet"].splitlines()
        for offset, line in enumerate(snippet[:12]):
            console.out(f"{r['start_line'] + offset:>5}  {line}", highlight=False)
        if len(snippet) > 12:
            console.print(f"[dim]      ... {len(snippet) - 12} more lines[/]")


def _start_dir(path: str | None) -> Path:
    """Where to look for the workspace: `--path ~/src/myrepo` names it (the README's example),
    so it must work from any current directory; without --path, the current dir."""
    if not path:
        return Path.cwd()
    target = Path(path).expanduser()
    return target if target.is_dir() else target.parent if target.exists() else Path.cwd()


def _find_root(start: Path, cfg: Settings) -> Path:
    for candidate in (start.resolve(), *start.resolve().parents):
        if (workspace_dir(cfg, candidate) / "state.sqlite").is_file():
            return candidate
    fail(f"no indexed workspace contains {start}; run `codeplane index` in it or pass --root")
