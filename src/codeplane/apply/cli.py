"""`codeplane apply FILE --edit SKETCH`: merge an edit into a file, print or write the result."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from codeplane.clikit import ConfigOption, JsonOption, err_console, fail, print_json, settings


def apply_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="File to change.", dir_okay=False)],
    edit: Annotated[Path, typer.Option("--edit", help="Edit to merge: a sketch with "
                                       "`... existing code ...` markers, SEARCH/REPLACE blocks, "
                                       "a unified diff or a whole file ('-' reads stdin).")],
    write: Annotated[bool, typer.Option("--write", help="Replace FILE atomically instead of "
                                        "printing the result.")] = False,
    model: Annotated[str, typer.Option(help="Local model for edits the deterministic merge "
                                       "declines.")] = "code-small",
    no_model: Annotated[bool, typer.Option("--no-model", help="Deterministic merge only.")
                        ] = False,
    json_: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Merge a model's edit into FILE exactly; nothing is written unless the result is valid.

    Exit code 0 when merged, 1 when the edit could not be applied (diagnostics say why),
    2 on bad input."""
    from codeplane.apply.service import apply_edit
    from codeplane.models.engine import Engine
    from codeplane.models.registry import UnknownModel

    # Through a symlink, the file is its target: read and written there, the link kept.
    # Resolved once, so the text merged is the text of the file replaced.
    target = file.resolve()
    original = _read(target, "file")
    sketch = sys.stdin.read() if str(edit) == "-" else _read(edit, "edit")
    engine = None if no_model else Engine(settings(ctx, config))
    try:
        result = apply_edit(original, sketch, str(file), engine, model)
    except UnknownModel as exc:
        fail(str(exc))
    finally:
        if engine is not None:
            engine.close()
    if result.ok and write:
        try:
            _write_atomic(target, result.merged or "")
        except OSError as exc:
            fail(f"cannot write {file}: {exc}")
    if json_:
        print_json({**result.to_json(include_merged=not write), "written": result.ok and write})
    elif result.ok and not write:
        sys.stdout.write(result.merged or "")
    for line in result.diagnostics:
        err_console.print(f"[yellow]apply:[/] {line}", highlight=False)
    if not result.ok:
        if not json_:
            err_console.print(f"[bold red]error:[/] edit not applied; {file} unchanged",
                              highlight=False)
        raise typer.Exit(1)


def _read(path: Path, what: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as fh:  # keep \r\n as it is
            return fh.read()
    except FileNotFoundError:
        fail(f"{what} not found: {path}")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {what} {path}: {exc}")


def _write_atomic(path: Path, text: str) -> None:
    """Write a sibling temp file, fsync, rename over: readers see the old or the new file,
    never a half-written one. The file's permission bits are kept. `path` is no symlink
    (the caller resolved it): renaming over a link would replace the link."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".apply", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
