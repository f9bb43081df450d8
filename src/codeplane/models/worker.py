"""A model's worker process: llama.cpp (and the local ONNX embedder) run here, never in the
server.

Native code that crashes (llama.cpp's AMX kernels segfault on the first decode on some
Xeons, issue #30; an out-of-memory kill) takes down this process only: the server answers the
request in flight with `engine_crashed` and starts a fresh worker (`engine.Engine`).

Start method: `subprocess.Popen` of a fresh interpreter (`python -P -m codeplane.models.worker
FD`; `-P`: the server's working directory, which may be a repository, is not put on the
worker's module path), never fork: the server is multi-threaded, and a forked copy of its threads' locks is
undefined behaviour. A plain subprocess rather than `multiprocessing`'s spawn: the worker's
stdout and stderr come back on one pipe the server reads (its last lines go into the crash
log), and nothing of the server's `__main__` is imported again. Messages are pickles over one
end of a socketpair, framed by `multiprocessing.connection.Connection`: length-prefixed,
and a dead peer reads as EOF.

What a worker loads is a `WorkerTarget`: a registry `ModelSpec` (a GGUF model) or an
`embed_worker.EmbedderTarget`; its `load` runs in the worker and returns the object jobs run on
and the facts the server gets back.

Protocol. Server -> worker: `(target, settings)` once, then `("job", id, name, args, adapter)`
(`adapter`: the LoRA adapter a model's job runs with, None for the base model,
`models/lora.py`) and `("cancel", id)`. Worker -> server: `("ready", info)` or `("failed",
exception)` once, then per job `("event", id, payload)`* and `("done", id, result)` or
`("error", id, exception)`. The server sends a job only after the previous one's reply.

The worker exits as soon as its socket reads EOF: the server closed it or died (the kernel
closes a dead process's sockets), so no worker outlives its server.

Not a security boundary: the worker runs as the server's user and the server unpickles what
it sends. It is a fault boundary.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import codeplane
from codeplane.models.jobs import JobContext, resolve

if TYPE_CHECKING:
    from codeplane.config import Settings
    from codeplane.models.lora import Adapter

log = logging.getLogger("codeplane.engine")
TAIL_LINES = 20  # lines of the worker's output kept for the crash log
CANCEL_POLL_S = 0.02  # how often a waiting call looks at its cancel event (if it has one)
STOP_WAIT_S = 5.0  # a stopped worker gets this long to exit before it is killed


class WorkerDied(Exception):
    """The worker process ended while the server waited on it."""

    def __init__(self, pid: int, cause: str, tail: list[str]) -> None:
        super().__init__(f"worker {pid} died ({cause})")
        self.pid, self.cause, self.tail = pid, cause, tail


class WorkerTarget(Protocol):
    """What one worker process loads (picklable: it crosses to the worker)."""

    name: str

    def load(self, settings: Settings) -> tuple[Any, Any]:
        """In the worker: (what the jobs run on, the facts the server gets as `info`)."""
        ...

    def use_adapter(self, loaded: Any, adapter: Adapter | None) -> None:
        """In the worker, before each job: make `loaded` run with `adapter` (None: as
        loaded). Raises (AdapterError, ValueError) for an adapter it cannot take."""
        ...

    def before_job(self, loaded: Any) -> None:
        """In the worker, before each job: adjust to the machine now (a model's threads)."""
        ...


class JobFailed(RuntimeError):
    """A job raised an exception that cannot be sent to the server as it is."""


class Worker:
    """One model's worker process, seen from the server. Not thread-safe: the engine calls
    it from the model's queue thread only (`stop` excepted)."""

    def __init__(self, target: WorkerTarget, settings: Settings) -> None:
        """Start the process and wait until it has loaded the model. Raises WorkerDied if it
        dies while loading, or the exception loading raised (missing weights, ...)."""
        self.name = target.name
        mine, theirs = _socketpair()
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "codeplane.models.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=_environment(),
                start_new_session=True)  # a terminal's Ctrl-C reaches the server only
        self.pid = self.proc.pid
        self.conn = mine
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._reader = threading.Thread(target=self._read_output, daemon=True,
                                        name=f"model-{self.name}-output")
        self._reader.start()
        self._ids = itertools.count()
        self.job: str | None = None  # the job in flight
        self._send((target, settings))
        kind, payload = self._recv()
        if kind == "failed":
            self.close()
            raise payload
        self.info = payload

    def call(self, job: str, args: tuple, on_event: Callable[[Any], None] | None,
             cancel: threading.Event | None, adapter: Adapter | None = None) -> Any:
        """Run `job` with `adapter` applied (None: the base model) and wait for its result,
        handing its events to `on_event` and forwarding `cancel` as a message. Raises what the
        job raised, or WorkerDied."""
        job_id = next(self._ids)
        self.job = job
        try:
            self._send(("job", job_id, job, args, adapter))
            return self._wait(job_id, on_event, cancel)
        finally:
            self.job = None

    def _wait(self, job_id: int, on_event: Callable[[Any], None] | None,
              cancel: threading.Event | None) -> Any:
        told = False  # the worker knows of the cancellation
        failed: BaseException | None = None  # on_event raised: cancel, then re-raise
        while True:
            if not told and (failed is not None or cancel is not None and cancel.is_set()):
                self._send(("cancel", job_id))
                told = True
            if not self._poll(CANCEL_POLL_S if cancel is not None and not told else None):
                continue
            kind, got, payload = self._recv()
            if got != job_id:
                continue  # a late reply to a job an earlier call gave up on
            if kind == "event":
                if on_event is not None and failed is None:
                    try:
                        on_event(payload)
                    except BaseException as exc:  # noqa: BLE001 - re-raised once the job stops
                        failed = exc
                continue
            if failed is not None:
                raise failed
            if kind == "error":
                raise payload
            return payload

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the process (any thread): a call in flight reads EOF."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        """Stop the process, reap it and close the socket (no call may be in flight)."""
        self.stop()
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self._reader.join(timeout=STOP_WAIT_S)

    def _send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except OSError:
            raise self.died() from None

    def _recv(self) -> Any:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise self.died() from None

    def _poll(self, timeout: float) -> bool:
        try:
            return self.conn.poll(timeout)
        except OSError:
            raise self.died() from None

    def died(self) -> WorkerDied:
        """The process is gone (or its socket broke: then it is killed): why. Closes the
        socket: this worker takes no more calls."""
        try:
            code = self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.conn.close()
        self._reader.join(timeout=STOP_WAIT_S)  # its last lines name the cause
        return WorkerDied(self.pid, exit_cause(code), list(self.tail))

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            log.info("model %s worker %d: %s", self.name, self.pid, line)
        self.proc.stdout.close()


def exit_cause(code: int) -> str:
    """A process's exit status in words: the signal's name, or the exit code."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _socketpair() -> tuple[Connection, Any]:
    """The server's connection and the socket to hand to the worker."""
    import socket

    mine, theirs = socket.socketpair()
    return Connection(mine.detach()), theirs


def _environment() -> dict[str, str]:
    """The server's environment, with this `codeplane` package first on the worker's path:
    the worker must run the server's code even where that is not the installed copy."""
    source = str(Path(codeplane.__file__).resolve().parent.parent)
    paths = [source, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


# -- the worker's side ------------------------------------------------------------------------


def main(fd: int) -> None:
    """The worker process: load the model, then run jobs until the socket closes."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    conn = Connection(fd)
    target, settings = conn.recv()
    inbox: queue.SimpleQueue[tuple[int, str, tuple, Adapter | None]] = queue.SimpleQueue()
    cancels: dict[int, threading.Event] = {}
    # Listening starts before the load: a server that dies meanwhile must still end us.
    threading.Thread(target=_listen, args=(conn, inbox, cancels), daemon=True,
                     name="listen").start()
    log.info("worker %d: loading model %s", os.getpid(), target.name)
    try:
        model, info = target.load(settings)
    except Exception as exc:  # noqa: BLE001 - sent to the server, raised for the request
        _send(conn, ("failed", _portable(exc)), ("failed", JobFailed(str(exc))))
        return
    _send(conn, ("ready", info), None)
    # Resident state per adapter: what a job keeps between jobs (Tab's saved KV slots) was
    # computed with the weights it ran with, and must not be reused under other weights.
    states: dict[Adapter | None, dict[str, Any]] = {}
    while True:
        job_id, name, args, adapter = inbox.get()
        ctx = JobContext(model, cancels[job_id],
                         lambda event, i=job_id: _send(conn, ("event", i, event), None),
                         states.setdefault(adapter, {}))
        try:
            target.use_adapter(model, adapter)  # an error is this job's, the model unchanged
            target.before_job(model)
            reply = ("done", job_id, resolve(name)(ctx, *args))
        except Exception as exc:
            if not isinstance(exc, ValueError):  # ValueErrors are the request's fault
                log.exception("job %s failed", name)
            reply = ("error", job_id, _portable(exc))
        cancels.pop(job_id, None)
        _send(conn, reply, ("error", job_id, JobFailed(f"{name} returned what cannot be "
                                                       "sent to the server")))


def _listen(conn: Connection, inbox: queue.SimpleQueue, cancels: dict[int, threading.Event]
            ) -> None:
    try:
        while True:
            message = conn.recv()
            if message[0] == "job":
                cancels[message[1]] = threading.Event()
                inbox.put(message[1:])
            elif message[0] == "cancel" and (event := cancels.get(message[1])) is not None:
                event.set()
    except (EOFError, OSError):
        os._exit(0)  # the server closed the socket or died: nothing left to do


def _send(conn: Connection, message: tuple, fallback: tuple | None) -> None:
    """Send `message`; if it cannot be pickled, `fallback` instead. Pickling happens before
    a byte is written, so a failure leaves the stream intact."""
    try:
        data = ForkingPickler.dumps(message)
    except Exception:
        if fallback is None:
            raise
        data = ForkingPickler.dumps(fallback)
    conn.send_bytes(data)


def _portable(exc: Exception) -> Exception:
    """`exc` if the server can rebuild it from a pickle, else a JobFailed naming it (some
    exceptions pickle but cannot be unpickled)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure means: not portable
        return JobFailed(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    # Through the module, not this `__main__` copy: classes the worker pickles (JobFailed)
    # must have the name the server imports them by.
    from codeplane.models.worker import main as worker_main

    worker_main(int(sys.argv[1]))
