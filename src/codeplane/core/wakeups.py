"""Wake-ups for event-stream readers: a run's worker thread stores an event, then wakes every
reader of that run on the reader's own event loop, so a stream reads the store as soon as
there is something new instead of on a timer. Shared by agent runs and background runs."""
from __future__ import annotations

import asyncio
import threading


class Wakeups:
    """Per-key sets of `asyncio.Event`s, each set on the loop that waits on it (the waker is
    usually another thread, where `Event.set` is not safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    def watch(self, key: str) -> asyncio.Event:
        """An event the calling loop can wait on; set whenever `wake(key)` runs."""
        wake = asyncio.Event()
        with self._lock:
            self._waiting.setdefault(key, set()).add((asyncio.get_running_loop(), wake))
        return wake

    def unwatch(self, key: str, wake: asyncio.Event) -> None:
        with self._lock:
            left = {w for w in self._waiting.get(key, set()) if w[1] is not wake}
            if left:
                self._waiting[key] = left
            else:
                self._waiting.pop(key, None)

    def wake(self, key: str) -> None:
        with self._lock:
            waiting = list(self._waiting.get(key, ()))
        for loop, wake in waiting:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # that watcher's event loop has closed (shutdown)
                self.unwatch(key, wake)
