"""`codeplane lsp`: Tab for any editor, as a Language Server on stdio (pygls).

Offers `textDocument/inlineCompletion` (ghost text: VS Code, Neovim 0.12+, Helix forks) and
plain `textDocument/completion` items as a fallback for editors without inline completion.
Per request it builds the client-side context (window + ring of recently viewed snippets),
asks the server's fast paths first (cache, typed-ahead: no debounce needed), then debounces
the model path and drops requests superseded by a newer keystroke. When a document is
opened, and when its edits pause, it asks the server to prefill that document's prompt
(`schedule_prefill`), so the first suggestion there does not pay for it. Accepting a suggestion
runs the `codeplane.tab.accepted` command; accepted and rejected suggestions are logged
locally and reported to the server (`POST /v1/tab/feedback`), which feeds the event lake.

Next edit (docs/tab.md, "Next edit"): every `didChange` goes into the edit history
(`tab/history.py`); when the newest edit is near the cursor and not plain typing, the inline
completion is the server's next edit (`POST /v1/tab/next`): an item whose `range` is the
lines it rewrites, and, when the same change is due elsewhere, the `codeplane.nextEdit.jump`
command (arguments: uri, 0-based line), which moves the editor there (`window/showDocument`):
in this document, or in another open one (the request carries the first of them, most
recently edited first, that still has the edit's old word, and the answer's path is mapped
back to its URI).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections import OrderedDict
from pathlib import Path

from lsprotocol import types as lsp
from pygls import uris
from pygls.lsp.server import LanguageServer
from pygls.workspace import TextDocument

from codeplane import __version__
from codeplane.core.languages import code_language
from codeplane.tab.client import AsyncTabClient, TabClientError
from codeplane.tab.context import CHARS_PER_TOKEN, Budget, Ring, build_request
from codeplane.tab.history import History
from codeplane.tab.related import Related, WorkspaceDefs
from codeplane.tab.telemetry import Telemetry
from codeplane.tab.words import occurrences, word_change

ACCEPT_COMMAND = "codeplane.tab.accepted"
JUMP_COMMAND = "codeplane.nextEdit.jump"
MAX_SNAPSHOTS = 64  # documents whose last text is kept to diff the next didChange against
MAX_DISK_BYTES = 1 << 20  # a document's first "before" may be read from disk up to this
# other open documents looked at for a next-edit request's jump (the first still holding the
# edit's old word is sent), and the largest sent: within `/v1/tab/next`'s bounds (nextedit.MAX_OPEN_FILES, MAX_OPEN_FILE_CHARS; a test
# checks), kept here so the editor's process does not import the server's modules
JUMP_DOCUMENTS = 8
JUMP_DOCUMENT_CHARS = 100_000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class TabLanguageServer(LanguageServer):
    def __init__(self, server_url: str, telemetry: Telemetry, debounce_ms: int,
                 min_confidence: float | None, workspace_context: bool = False,
                 api_key: str | None = None, prefill_idle_ms: int | None = None) -> None:
        super().__init__("codeplane-tab", __version__)
        self.options = {} if min_confidence is None else {"min_confidence": min_confidence}
        self.tab = AsyncTabClient(server_url, api_key)
        self.telemetry = telemetry
        self.debounce_s = debounce_ms / 1000
        self.ring = Ring()
        self.defs = WorkspaceDefs()
        self.related = Related(self.defs) if workspace_context else None
        self._scanned: set[str] = set()  # languages whose workspace files were read
        self._latest: dict[str, int] = {}
        self._where: tuple[str, int] | None = None  # (uri, line) of the last request
        self._shown: str | None = None  # id of the suggestion on screen (the server's)
        self.prefill_idle_s = None if prefill_idle_ms is None else prefill_idle_ms / 1000
        self._prefills: dict[str, asyncio.Task] = {}  # the pending prefill of each document
        self.history = History()
        self._texts: OrderedDict[str, str] = OrderedDict()  # uri -> text at the last change

    async def suggest(self, uri: str, position: lsp.Position) -> tuple[str, str] | None:
        """(text, suggestion id) for the cursor, or None when nothing should show."""
        doc = self.workspace.get_text_document(uri)
        source = doc.source
        offset = doc.offset_at_position(position)
        self._note_position(uri, position.line)
        ticket = self._latest[uri] = self._latest.get(uri, 0) + 1
        path = self._path(uri)
        related = self._related(path)
        body = build_request(path, source, offset, self.ring, Budget(), related,
                             cursor_id=uri, language=doc.language_id, **self.options)
        try:
            result = await self.tab.complete({**body, "fast_only": True})
            if result["source"] == "miss":
                await asyncio.sleep(self.debounce_s)
                if self._latest.get(uri) != ticket:
                    return None  # superseded by a newer keystroke during the debounce
                result = await self.tab.complete(body)
        except TabClientError as exc:
            self.window_log_message(lsp.LogMessageParams(lsp.MessageType.Warning, str(exc)))
            return None
        if self._latest.get(uri) != ticket or not result["text"]:
            return None
        return result["text"], await self._record(result, doc.language_id)

    # -- next edit (tab/nextedit.py) ------------------------------------------------------

    def note_change(self, uri: str) -> None:
        """didChange (pygls has applied it): the text before it against the text now goes
        into the edit history. The text before is the one seen at the last change; before
        the first change, the file on disk (what the editor opened, unless it was unsaved)."""
        new = self.workspace.get_text_document(uri).source
        old = self._texts.pop(uri, None)
        if old is None:
            old = _disk_text(uri)
        self._texts[uri] = new
        while len(self._texts) > MAX_SNAPSHOTS:
            self._texts.popitem(last=False)
        if old is not None:
            self.history.record(self._path(uri), old, new)

    async def next_edit(self, uri: str, position: lsp.Position
                        ) -> lsp.InlineCompletionItem | None:
        """The server's next edit as an inline item replacing a range, or None."""
        doc = self.workspace.get_text_document(uri)
        ticket = self._latest[uri] = self._latest.get(uri, 0) + 1
        others = self._other_documents(uri)
        body = {**self._next_body(uri, doc.source, position),
                "open_files": self._jump_files(others)}
        try:  # the rewrite decodes a whole window: it may take longer than FIM
            result = await self.tab.next_edit(body)
        except TabClientError as exc:
            self.window_log_message(lsp.LogMessageParams(lsp.MessageType.Warning, str(exc)))
            return None
        found, jump = result.get("suggestion"), result.get("jump")
        targets = {body["path"]: uri, **{path: u for path, (u, _) in others.items()}}
        jump_uri = targets.get(jump["path"]) if jump else None  # a path not sent: no jump
        if self._latest.get(uri) != ticket or not (found or jump_uri):
            return None
        sid = None
        if result.get("id"):  # shown: logged, and its accept reported, as FIM's
            sid = await self._record({"id": result["id"], "text": found["text"],
                                      "latency_ms": result["latency_ms"],
                                      "source": f"next_{result['source']}",
                                      "confidence": result["probability"]}, doc.language_id)
        command = lsp.Command(title="codeplane: go to the next edit", command=JUMP_COMMAND,
                              arguments=[jump_uri, jump["line"], sid]) if jump_uri else \
            _accept(sid) if sid else None
        if not found:  # a jump alone: nothing to insert, the command moves the cursor
            here = lsp.Range(position, position)
            return lsp.InlineCompletionItem(insert_text="", range=here, command=command)
        lines = doc.source.splitlines(keepends=True)
        start = sum(len(x) for x in lines[:found["start_line"]])
        end = sum(len(x) for x in lines[:found["end_line"]])
        rng = lsp.Range(_position(doc.source, start), _position(doc.source, end))
        return lsp.InlineCompletionItem(insert_text=found["text"], range=rng, command=command)

    def _other_documents(self, uri: str) -> dict[str, tuple[str, str]]:
        """The editor's other open documents a jump may lead to, as path -> (uri, text):
        the most recently edited first, then the rest as opened; bounded in count, a
        document over the API's size left out, and a path that names two documents (or the
        current one: basenames outside the workspace root) kept for the first only."""
        docs = self.workspace.text_documents
        edited = [u for u in reversed(self._texts) if u in docs]
        taken = {self._path(uri)}
        found: dict[str, tuple[str, str]] = {}
        for other in dict.fromkeys([*edited, *docs]):
            path, text = self._path(other), docs[other].source
            if (other == uri or path in taken or len(text) > JUMP_DOCUMENT_CHARS
                    or _CONTROL.search(path)):  # no editor's path: the API refuses it
                continue
            taken.add(path)
            found[path] = (other, text)
            if len(found) == JUMP_DOCUMENTS:
                break
        return found

    def _jump_files(self, others: dict[str, tuple[str, str]]) -> list[dict]:
        """The one open document the server's jump can lead to: the first of `others` where
        the newest edit's old word still occurs (`nextedit.jump_for` reads no other), or
        none when that edit is not a one-word change. Sending every open document would
        cost each request up to JUMP_DOCUMENTS x JUMP_DOCUMENT_CHARS for the same answer."""
        recent = self.history.recent()
        change = word_change(recent[-1].before, recent[-1].after) if recent else None
        if change is None:
            return []
        for path, (_, text) in others.items():
            if occurrences(text, change[0]):
                return [{"path": path, "text": text}]
        return []

    def _next_body(self, uri: str, source: str, position: lsp.Position) -> dict:
        """The next-edit request at `position` (`POST /v1/tab/next` and its prefill)."""
        return {"path": self._path(uri), "text": source, "cursor_id": uri,
                "cursor": {"line": position.line, "character": position.character},
                "edits": [e.to_json() for e in self.history.recent()]}

    async def _record(self, result: dict, language: str | None) -> str:
        """Log a newly shown suggestion; the one it replaces counts as rejected. The server
        keeps one id across typed-ahead, so a suggestion being typed out is not replaced."""
        suggestion_id = result["id"]
        if self._shown == suggestion_id:
            return suggestion_id
        if self._shown:
            await self.report(self._shown, "rejected")
        self._shown = suggestion_id
        self.telemetry.shown(suggestion_id, latency_ms=result["latency_ms"],
                             chars=len(result["text"]), source=result["source"],
                             confidence=result.get("confidence"), language=language)
        return suggestion_id

    async def accept(self, suggestion_id: str) -> bool:
        """The editor took the suggestion (its item's command ran)."""
        if self._shown == suggestion_id:
            self._shown = None
        return await self.report(suggestion_id, "accepted")

    async def report(self, suggestion_id: str, outcome: str) -> bool:
        """Record the outcome locally and send it to the server (unless telemetry is off);
        False when it does not count (unknown id, or replaced before it was really seen)."""
        event = (self.telemetry.accepted if outcome == "accepted"
                 else self.telemetry.rejected)(suggestion_id)
        if event is None:
            return False
        if self.telemetry.path is not None:
            try:
                await self.tab.feedback(suggestion_id, outcome, event["after_ms"])
            except TabClientError as exc:  # expired on the server, or unreachable: local only
                self.window_log_message(lsp.LogMessageParams(lsp.MessageType.Log, str(exc)))
        return True

    def schedule_prefill(self, uri: str, offset: int | None = None) -> None:
        """Prefill `uri` once it has gone `prefill_idle_s` without a newer call (an edit),
        cancelling the pending one: the server evaluates the prompt a completion at `offset`
        (the last edit; None: the file's first window) would start with."""
        if self.prefill_idle_s is None:
            return
        if (pending := self._prefills.pop(uri, None)) is not None:
            pending.cancel()
        self._prefills[uri] = asyncio.get_running_loop().create_task(
            self._prefill(uri, offset))

    async def _prefill(self, uri: str, offset: int | None) -> None:
        """The prompt the next request at `offset` will send: next edit's when the history
        says the request there will be a next edit (`wants_next_edit`), FIM's otherwise."""
        await asyncio.sleep(self.prefill_idle_s)
        doc = self.workspace.get_text_document(uri)
        source = doc.source
        path = self._path(uri)
        at = _position(source, min(offset, len(source))) if offset is not None else None
        try:
            if at is not None and self.history.wants_next_edit(path, at.line):
                await self.tab.next_prefill(self._next_body(uri, source, at))
                return
            if offset is None:  # where the first window of the file ends (context.window)
                offset = source.rfind("\n", 0, Budget().prefix_tokens * CHARS_PER_TOKEN) + 1
            body = build_request(path, source, min(offset, len(source)), self.ring, Budget(),
                                 self._related(path), cursor_id=uri, language=doc.language_id)
            prefix = body.pop("prefix")
            body.update(text=prefix + body.pop("suffix"), cursor=len(prefix))
            await self.tab.prefill(body)
        except TabClientError as exc:
            self.window_log_message(lsp.LogMessageParams(lsp.MessageType.Log, str(exc)))
        finally:
            if self._prefills.get(uri) is asyncio.current_task():
                del self._prefills[uri]

    def _related(self, path: str) -> Related | None:
        """Definitions context over the workspace: its files of this language are read once
        (client side, bounded), open documents are re-read as they are left or edited."""
        language = code_language(path)
        if self.related is None or language is None:
            return None
        root = self.workspace.root_path
        if root and language not in self._scanned:
            self._scanned.add(language)
            self.defs.scan(Path(root), path)
        return self.related

    def _note_position(self, uri: str, line: int) -> None:
        """Switching files puts a chunk of the one left into the ring (recently viewed)
        and its current text into the definitions index (it may have been edited)."""
        if self._where and self._where[0] != uri:
            old_uri, old_line = self._where
            try:  # a closed document is read from disk; gone: nothing to remember
                old = self.workspace.get_text_document(old_uri).source
            except OSError:
                old = ""
            if old:
                self.ring.add(self._path(old_uri), old, old_line)
                self.defs.add(self._path(old_uri), old)
        self._where = (uri, line)

    def _path(self, uri: str) -> str:
        path = uris.to_fs_path(uri) or uri
        root = self.workspace.root_path
        if root and path.startswith(root.rstrip(os.sep) + os.sep):
            return os.path.relpath(path, root)
        return os.path.basename(path)


def _position(text: str, offset: int) -> lsp.Position:
    """LSP position of a character offset (characters, not UTF-16 units: see docs/tab.md)."""
    line = text.count("\n", 0, offset)
    return lsp.Position(line, offset - (text.rfind("\n", 0, offset) + 1))


def _disk_text(uri: str) -> str | None:
    path = uris.to_fs_path(uri)
    try:
        if path and os.path.getsize(path) <= MAX_DISK_BYTES:
            return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    return None


def _accept(suggestion_id: str) -> lsp.Command:
    return lsp.Command(title="codeplane: suggestion accepted", command=ACCEPT_COMMAND,
                       arguments=[suggestion_id])


def _edit_end(doc: TextDocument, change: lsp.TextDocumentContentChangeEvent) -> int | None:
    """Offset (in the updated document) where an incremental change's text ends; None for
    a whole-document change."""
    if not isinstance(change, lsp.TextDocumentContentChangePartial):
        return None
    return doc.offset_at_position(change.range.start) + len(change.text)


def create_server(server_url: str, telemetry: Telemetry, debounce_ms: int = 120,
                  min_confidence: float | None = None, workspace_context: bool = False,
                  api_key: str | None = None, prefill_idle_ms: int | None = 500
                  ) -> TabLanguageServer:
    ls = TabLanguageServer(server_url, telemetry, debounce_ms, min_confidence,
                           workspace_context, api_key, prefill_idle_ms)

    @ls.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
    async def did_open(server: TabLanguageServer, params: lsp.DidOpenTextDocumentParams
                       ) -> None:
        server.schedule_prefill(params.text_document.uri)

    @ls.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
    async def did_change(server: TabLanguageServer, params: lsp.DidChangeTextDocumentParams
                         ) -> None:
        """The edit goes into the history (next edit), then the idle prefill is rescheduled
        at its end (the first suggestion there does not pay for the prompt)."""
        uri = params.text_document.uri
        server.note_change(uri)
        last = params.content_changes[-1] if params.content_changes else None
        server.schedule_prefill(uri, last and _edit_end(
            server.workspace.get_text_document(uri), last))

    @ls.feature(lsp.TEXT_DOCUMENT_INLINE_COMPLETION, lsp.InlineCompletionOptions())
    async def inline_completion(server: TabLanguageServer, params: lsp.InlineCompletionParams
                                ) -> lsp.InlineCompletionList | None:
        uri = params.text_document.uri
        if server.history.wants_next_edit(server._path(uri), params.position.line):
            item = await server.next_edit(uri, params.position)
            if item is not None:
                return lsp.InlineCompletionList(items=[item])
        found = await server.suggest(uri, params.position)
        if found is None:
            return lsp.InlineCompletionList(items=[])
        text, sid = found
        here = lsp.Range(params.position, params.position)
        return lsp.InlineCompletionList(items=[lsp.InlineCompletionItem(
            insert_text=text, range=here,
            command=_accept(sid))])

    @ls.feature(lsp.TEXT_DOCUMENT_COMPLETION,
                lsp.CompletionOptions(trigger_characters=[".", "(", " ", "="]))
    async def completion(server: TabLanguageServer, params: lsp.CompletionParams
                         ) -> lsp.CompletionList:
        found = await server.suggest(params.text_document.uri, params.position)
        if found is None:
            return lsp.CompletionList(is_incomplete=True, items=[])
        text, sid = found
        here = lsp.Range(params.position, params.position)
        label = text.strip().split("\n", 1)[0][:80] or text[:80]
        return lsp.CompletionList(is_incomplete=True, items=[lsp.CompletionItem(
            label=label, kind=lsp.CompletionItemKind.Snippet, detail="codeplane Tab",
            text_edit=lsp.TextEdit(here, text), filter_text=label, sort_text="0",
            insert_text_format=lsp.InsertTextFormat.PlainText,
            command=_accept(sid))])

    @ls.command(JUMP_COMMAND)
    async def jump(server: TabLanguageServer, uri: str, line: int,
                   suggestion_id: str | None = None) -> bool:
        """Move the editor to the next edit's place (the client runs this on accept); the
        rewrite the item carried, if any, was accepted."""
        if suggestion_id:
            await server.accept(suggestion_id)
        here = lsp.Range(lsp.Position(line, 0), lsp.Position(line, 0))
        shown = await server.window_show_document_async(
            lsp.ShowDocumentParams(uri, take_focus=True, selection=here))
        return bool(shown and shown.success)

    @ls.command(ACCEPT_COMMAND)
    async def accepted(server: TabLanguageServer, suggestion_id: str) -> bool:
        return await server.accept(suggestion_id)

    @ls.feature(lsp.SHUTDOWN)
    async def shutdown(server: TabLanguageServer, _: object) -> None:
        await server.tab.close()

    return ls
