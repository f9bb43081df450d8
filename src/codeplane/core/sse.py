"""One reader for OpenAI-style server-sent event streams (`data: {json}` lines, `data: [DONE]`),
and one writer of a resumable stream of stored, numbered events (`follow`: agent runs and
background agents).

The gateway's OpenAI provider and the agent's HTTP model both read this format; they share
the rules that decide when a stream is broken: a chunk that is not a JSON object, an in-band
`{"error": ...}` (an object or, from some servers, a bare string), or an end without
`[DONE]` is an error, never a short answer. Each caller maps `StreamError` to its own error
type (the gateway's retryable UpstreamError, the agent's ModelError).

Hand-written rather than httpx-sse: that library is not a dependency, and every stream read
here sends one `data:` line per event, so multi-line data fields and event ids (what a full
SSE parser adds) never occur; what matters is the error rules above, which no SSE library has.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from codeplane.core.errors import APIError

DONE = "[DONE]"
MAX_EVENT_ID = 2**63 - 1  # the largest integer a database column of event numbers holds


def resume_after(last_event_id: str | None) -> int:
    """The event number a reconnecting SSE client saw last, from its `Last-Event-ID` header
    (0: none, send from the first). Anything that is not an event number a store can hold is
    a 400: past 64 bits the databases' drivers raise instead of comparing; and ASCII digits
    only, since `str.isdigit()` also takes `²` (a header byte 0xB2) or `١`, which `int()`
    refuses."""
    if last_event_id is None:
        return 0
    text = last_event_id.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_EVENT_ID:
        raise APIError(400, "Last-Event-ID must be an event id (a non-negative 64-bit integer)",
                       param="last-event-id")
    return int(text)


Events = list[tuple[int, dict[str, Any]]]


async def follow(read: Callable[[int], Awaitable[tuple[Events, bool]]], wake: asyncio.Event,
                 after: int, poll_s: float, keepalive_s: float) -> AsyncIterator[str]:
    """SSE lines of a stored event log, each event with its number as `id:` (what a client
    sends back as `Last-Event-ID`): those numbered above `after`, then new ones as they are
    stored, until `read(after)` says the log has ended. `read` returns the events after a
    number and whether nothing more will come; the writer of the log sets `wake` when it
    stores one, and `poll_s` bounds the wait where it cannot (another replica's writes). After
    `keepalive_s` without an event a comment line goes out: also how a hang-up is noticed
    under ASGI servers that report it only on send."""
    quiet = 0.0
    while True:
        wake.clear()  # before reading: an event stored meanwhile wakes us again
        events, ended = await read(after)
        for seq, event in events:
            yield f"id: {seq}\ndata: {json.dumps(event, default=str)}\n\n"
            after, quiet = seq, 0.0
        if ended:
            return
        try:
            await asyncio.wait_for(wake.wait(), poll_s)
        except TimeoutError:
            quiet += poll_s
            if quiet >= keepalive_s:
                quiet = 0.0
                yield ": keep-alive\n\n"


class StreamError(Exception):
    """The stream is broken or reported a failure; `code` is the upstream's error code when
    it sent one, else "bad_stream"."""

    def __init__(self, message: str, code: str = "bad_stream") -> None:
        super().__init__(message)
        self.message, self.code = message, code


def chunk_error(chunk: dict[str, Any]) -> StreamError | None:
    """The in-band error a chunk carries, if any, whatever shape the server gave it."""
    if "error" not in chunk:
        return None
    err = chunk["error"]
    message, code = (err.get("message"), err.get("code")) if isinstance(err, dict) else (err, None)
    return StreamError(f"failed mid-stream: {message}", str(code) if code else "stream_error")


class ChunkReader:
    """Turns lines into chunks, one line at a time: the agent's blocking reader (which also
    checks for cancellation between lines) and `aiter_chunks` below both use it."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, line: str) -> dict[str, Any] | None:
        """The chunk a line carries; None for comments, keep-alives, event names and
        `[DONE]` (which sets `done`). Raises StreamError for a malformed or error chunk."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == DONE:
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            raise StreamError(f"sent a malformed chunk: {data[:120]!r}")
        error = chunk_error(chunk)
        if error is not None:
            raise error
        return chunk

    def end(self) -> None:
        """The lines ran out: fine after `[DONE]`, a cut connection otherwise."""
        if not self.done:
            raise StreamError("ended without [DONE] (connection cut)")


async def aiter_chunks(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """Chunks of a stream read asynchronously; stops at `[DONE]`."""
    reader = ChunkReader()
    async for line in lines:
        chunk = reader.feed(line)
        if reader.done:
            return
        if chunk is not None:
            yield chunk
    reader.end()
