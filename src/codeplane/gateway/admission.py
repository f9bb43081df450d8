"""Admission control: token buckets (per key, per client IP, per deployment) and the
priority gate that queues and sheds requests per model.

Written by hand rather than with a rate-limit library because the gate must share one
capacity figure with the router (slow start and cooldowns shrink it) and shed by class.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

from codeplane.gateway.config import PRIORITIES, GatewayConfig


class Shed(Exception):
    """Refused at admission: 429 with the number of seconds after which a retry may pass."""

    def __init__(self, message: str, retry_after: float, code: str = "rate_limit_exceeded",
                 status: int = 429) -> None:
        super().__init__(message)
        self.message, self.code, self.status = message, code, status
        self.retry_after = max(1, math.ceil(retry_after))


class TokenBucket:
    """`rate` units per minute with a burst of one minute's worth. Calls reserve their
    estimate first and settle the difference after, which may overdraw a bucket; an
    overdrawn bucket refuses until it has refilled above zero."""

    __slots__ = ("capacity", "level", "per_s", "stamp")

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.per_s = per_minute / 60.0
        self.level = self.capacity
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.per_s)
        self.stamp = now

    def wait_s(self, need: float = 1.0) -> float:
        """0 if `need` units are available now (refusing nothing), else seconds to wait."""
        self._refill()
        need = min(need, self.capacity) if need > 0 else 1e-9
        if self.level >= need:
            return 0.0
        return (need - self.level) / self.per_s

    def take(self, amount: float) -> None:
        """Spend `amount` (negative: give back an over-reservation, up to the burst)."""
        self._refill()
        self.level = min(self.capacity, self.level - amount)

    @property
    def full(self) -> bool:
        self._refill()
        return self.level >= self.capacity


class PriorityGate:
    """Bounded per-class queues in front of one model's deployments.

    A request runs when fewer than `capacity()` requests are in flight for the model and its
    class may use that much of the capacity (`share`: batch gets at most half, so interactive
    finds room even while batch saturates its part). Otherwise it waits in its class queue;
    a freed slot goes to the oldest waiter of the highest class. A full queue or a wait longer
    than the class's timeout is shed with 429: lower classes have shorter queues, smaller
    shares and are served last, so they are shed first.
    """

    POLL_S = 0.1  # capacity can grow without a release (cooldown ends, slow start ramps)

    def __init__(self, model: str, cfg: GatewayConfig, capacity: Callable[[], float]) -> None:
        self.model, self.cfg, self.capacity = model, cfg, capacity
        self.inflight = 0
        self.by_class = dict.fromkeys(PRIORITIES, 0)
        self.queues: dict[str, deque[asyncio.Future]] = {p: deque() for p in PRIORITIES}
        self.service_s = 0.05  # EWMA of slot hold time, for Retry-After estimates

    def _room(self, priority: str) -> bool:
        cap = self.capacity()
        if self.inflight >= cap:
            return False
        limit = max(1.0, cap * self.cfg.share[priority]) if cap != math.inf else math.inf
        below = PRIORITIES[PRIORITIES.index(priority) + 1:]
        # A class's share counts itself and every class below it.
        used = self.by_class[priority] + sum(self.by_class[p] for p in below)
        return used < limit

    def _ahead(self, priority: str) -> bool:
        """Anyone of this or a higher class already waiting?"""
        upto = PRIORITIES.index(priority) + 1
        return any(self.queues[p] for p in PRIORITIES[:upto])

    def _enter(self, priority: str) -> None:
        self.inflight += 1
        self.by_class[priority] += 1

    async def acquire(self, priority: str,
                      down: Callable[[], Exception | None] | None = None) -> float:
        """Wait for a slot; return seconds waited. Raises Shed, or what `down()` returns
        once the model has no deployment left to wait for (the caller tries a fallback)."""
        if not self._ahead(priority) and self._room(priority):
            self._enter(priority)
            return 0.0
        queue = self.queues[priority]
        if len(queue) >= self.cfg.queue[priority]:
            raise Shed(f"{self.model}: the {priority} queue is full "
                       f"({len(queue)} waiting); retry later", self._estimate(priority))
        start = time.monotonic()
        deadline = start + self.cfg.queue_timeout_s[priority]
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), self.POLL_S)
                except TimeoutError:
                    pass
                if fut.done():
                    return time.monotonic() - start  # handed a slot by release()
                if queue[0] is fut and not self._ahead_of(priority) and self._room(priority):
                    queue.popleft()
                    self._enter(priority)
                    return time.monotonic() - start
                if down is not None and (gone := down()) is not None:
                    raise gone
                if time.monotonic() >= deadline:
                    raise Shed(f"{self.model}: waited {self.cfg.queue_timeout_s[priority]:g}s "
                               f"in the {priority} queue; retry later",
                               self._estimate(priority))
        except BaseException:
            if fut.done() and not fut.cancelled():  # handed a slot, but the caller left
                self.release(priority, self.service_s)
            raise
        finally:
            if not fut.done():
                fut.cancel()
            if fut in queue:
                queue.remove(fut)

    def _ahead_of(self, priority: str) -> bool:
        return any(self.queues[p] for p in PRIORITIES[:PRIORITIES.index(priority)])

    def release(self, priority: str, held_s: float) -> None:
        self.inflight -= 1
        self.by_class[priority] -= 1
        self.service_s += 0.1 * (held_s - self.service_s)
        self._wake()

    def _wake(self) -> None:
        for p in PRIORITIES:
            queue = self.queues[p]
            while queue and queue[0].done():  # timed out or cancelled waiters
                queue.popleft()
            if queue and self._room(p):
                fut = queue.popleft()
                self._enter(p)
                fut.set_result(True)
                return
            if queue:
                return  # the head of a higher class waits: never let a lower class pass it

    def _estimate(self, priority: str) -> float:
        cap = self.capacity()
        cap = cap if cap != math.inf and cap > 0 else max(1, self.inflight)
        waiting = sum(len(self.queues[p]) for p in PRIORITIES[:PRIORITIES.index(priority) + 1])
        return self.service_s * (waiting + 1) / cap

    def snapshot(self) -> dict:
        return {"inflight": self.inflight, "capacity": self.capacity(),
                "queued": {p: len(q) for p, q in self.queues.items()}}

