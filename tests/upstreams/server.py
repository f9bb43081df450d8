"""A fast fake OpenAI-compatible (and Anthropic Messages) upstream that can misbehave.

Plain asyncio HTTP/1.1 with keep-alive, so it is cheap enough to sit behind a load test and
precise enough to fail on purpose: HTTP 5xx, 429 with Retry-After, a slow first token, a
stream cut mid-way (socket closed without the terminating chunk), malformed chunks, stalls.
Run it in a thread (`Upstream(...).start()`) from tests, or as a process for benchmarks:
`python tests/upstreams/server.py --port 9001`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from dataclasses import dataclass, field

MODES = ("ok", "500", "429", "slow_first", "cut", "malformed", "stall", "error_event")


@dataclass
class Upstream:
    name: str = "up"
    port: int = 0
    mode: str = "ok"
    retry_after: int = 3
    delay_s: float = 0.0  # before the response (or first chunk)
    chunk_delay_s: float = 0.0
    chunks: int = 5
    fail_after_chunks: int = 2  # for cut / malformed / stall
    hits: int = 0
    active: int = 0
    max_active: int = 0
    bodies: list = field(default_factory=list)
    keep_bodies: bool = True

    # -- lifecycle (thread) --------------------------------------------------------------

    def start(self) -> Upstream:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self.port))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(close(), self._loop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self, mode: str = "ok") -> None:
        self.mode, self.hits, self.max_active = mode, 0, 0
        self.bodies.clear()

    # -- HTTP ----------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in lines[1:] if ":" in line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._respond(method, path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, path: str, raw: bytes,
                       writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False closes the connection."""
        if method == "GET":
            _send(writer, 200, {"status": "ok", "name": self.name})
            return True
        self.hits += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            body = json.loads(raw or b"{}")
            if self.keep_bodies:
                self.bodies.append(body)
            mode = self.mode
            if mode == "500":
                _send(writer, 500, {"error": {"message": f"{self.name} is broken",
                                              "type": "server_error"}})
                return True
            if mode == "429":
                _send(writer, 429, {"error": {"message": "slow down", "type": "rate_limit"}},
                      {"retry-after": str(self.retry_after)})
                return True
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if mode == "slow_first":
                await asyncio.sleep(30)
            anthropic = path.endswith("/messages")
            if not body.get("stream"):
                _send(writer, 200, self._anthropic(body) if anthropic else self._openai(path, body))
                return True
            await self._stream(writer, body, anthropic)
            return mode not in ("cut",)
        finally:
            self.active -= 1

    # -- bodies --------------------------------------------------------------------------

    def _text(self) -> str:
        return f"hello from {self.name}"

    def _openai(self, path: str, body: dict) -> dict:
        usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
        if path.endswith("/embeddings"):
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            return {"object": "list", "model": body["model"], "usage": usage,
                    "data": [{"object": "embedding", "index": i, "embedding": [0.1, 0.2]}
                             for i in range(len(inputs))]}
        if path.endswith("/completions") and "chat" not in path:
            return {"id": "cmpl-1", "object": "text_completion", "created": 0,
                    "model": body["model"], "usage": usage,
                    "choices": [{"index": 0, "text": self._text(), "finish_reason": "stop"}]}
        message: dict = {"role": "assistant", "content": self._text()}
        finish = "stop"
        if body.get("tools"):
            name = body["tools"][0]["function"]["name"]
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": name, "arguments": '{"city": "Paris"}'}}]}
            finish = "tool_calls"
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                "model": body["model"], "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}

    def _anthropic(self, body: dict) -> dict:
        content: list = [{"type": "text", "text": self._text()}]
        stop = "end_turn"
        if body.get("tools"):
            content.append({"type": "tool_use", "id": "toolu_1",
                            "name": body["tools"][0]["name"], "input": {"city": "Paris"}})
            stop = "tool_use"
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                "content": content, "stop_reason": stop,
                "usage": {"input_tokens": 9, "output_tokens": 4}}

    def _events(self, body: dict, anthropic: bool) -> list[str]:
        if anthropic:
            events = [{"type": "message_start", "message": {"usage": {"input_tokens": 9}}},
                      {"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}]
            events += [{"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": f"tok{i} "}}
                       for i in range(self.chunks)]
            events.append({"type": "content_block_stop", "index": 0})
            stop = "end_turn"
            if body.get("tools"):
                stop = "tool_use"
                events += [{"type": "content_block_start", "index": 1, "content_block": {
                    "type": "tool_use", "id": "toolu_1", "name": body["tools"][0]["name"],
                    "input": {}}},
                    {"type": "content_block_delta", "index": 1, "delta": {
                        "type": "input_json_delta", "partial_json": '{"city": '}},
                    {"type": "content_block_delta", "index": 1, "delta": {
                        "type": "input_json_delta", "partial_json": '"Paris"}'}},
                    {"type": "content_block_stop", "index": 1}]
            events += [{"type": "message_delta", "delta": {"stop_reason": stop},
                        "usage": {"output_tokens": self.chunks}},
                       {"type": "message_stop"}]
            return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": body["model"]}

        def chunk(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({**base, "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({"content": f"tok{i} "}) for i in range(self.chunks)]
        out.append(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": self.chunks,
                     "total_tokens": 7 + self.chunks}
            out.append("data: " + json.dumps({**base, "choices": [], "usage": usage}) + "\n\n")
        out.append("data: [DONE]\n\n")
        return out

    async def _stream(self, writer: asyncio.StreamWriter, body: dict, anthropic: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i, event in enumerate(self._events(body, anthropic)):
            if i == self.fail_after_chunks:
                if self.mode == "cut":
                    await writer.drain()
                    writer.transport.abort()  # no terminating chunk: a broken connection
                    return
                if self.mode == "malformed":
                    event = "data: {this is not json\n\n"
                if self.mode == "stall":
                    await asyncio.sleep(30)
                if self.mode == "error_event":
                    event = 'data: {"error": {"message": "upstream overloaded"}}\n\n'
            data = event.encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            if self.chunk_delay_s:
                await writer.drain()
                await asyncio.sleep(self.chunk_delay_s)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _send(writer: asyncio.StreamWriter, status: int, body: dict,
          headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n{extra}\r\n".encode() + data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=5)
    args = parser.parse_args()
    up = Upstream(name=f"up{args.port}", port=args.port, chunks=args.chunks, keep_bodies=False)

    async def serve() -> None:
        server = await asyncio.start_server(up._handle, "127.0.0.1", args.port, backlog=4096)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
