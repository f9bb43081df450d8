"""Admission control: token buckets (per key, per client IP, per deployment) and the
priority gate that queues and sheds requests per model.

Written by hand rather than with a rate-limit library because the gate must share one
capacity figure with the router (slow start and cooldowns shrink it) and shed by class.
A key's and a client address's buckets are `SharedBuckets` rows in the server database, so
they hold across workers and replicas; a deployment's stay in memory (`TokenBucket`), since
each process already gets its share of the upstream's limits (`RemoteDeployment.share`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

from sqlalchemy import Column, Table, case, delete, select, update

from codeplane.config.gateway import PRIORITIES, GatewayConfig
from codeplane.storage.database import Database


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


class SharedBuckets:
    """`TokenBucket`s by name in a database table (name, level, updated): the refill and the
    spend are one conditional UPDATE, which the database applies atomically, so any number of
    workers and replicas share one bucket exactly (Redis would do the same; the database is
    already there and one UPDATE is all it takes). Times are wall-clock seconds, so hosts
    need NTP (as their leases do)."""

    def __init__(self, db: Database, table: Table, name: Column) -> None:
        self.db, self.table, self.name = db, table, name

    def take(self, name: str, per_minute: int, amount: float, now: float | None = None) -> float:
        """Spend `amount` if the bucket holds it (or a minute's worth, for more): 0.0 when
        spent, else the seconds until it will be there (nothing spent)."""
        now = time.time() if now is None else now
        need = float(min(amount, per_minute)) if amount > 0 else 1e-9
        level = self._refilled(per_minute, now)
        row = self.name == name
        with self.db.write() as conn:
            conn.execute(self.db.insert(self.table).values(
                {self.name.key: name, "level": float(per_minute), "updated": now})
                .on_conflict_do_nothing())
            if conn.execute(update(self.table).where(row, level >= need)
                            .values(level=level - amount, updated=now)).rowcount == 1:
                return 0.0
            have = conn.scalar(select(level).where(row))
        return (need - have) * 60 / per_minute

    def spend(self, name: str, per_minute: int, amount: float,
              now: float | None = None) -> None:
        """Spend `amount` more without asking (negative: give back what a call held and
        did not use), never above a minute's worth."""
        if amount:
            now = time.time() if now is None else now
            with self.db.write() as conn:
                conn.execute(update(self.table).where(self.name == name).values(
                    level=_capped(self._refilled(per_minute, now) - amount, per_minute),
                    updated=now))

    def prune(self, idle_s: float = 120.0) -> int:
        """Drop buckets untouched for `idle_s` (full again by then: a burst is one minute's
        worth), so many distinct client addresses cannot grow the table; how many."""
        with self.db.write() as conn:
            return conn.execute(delete(self.table).where(
                self.table.c.updated < time.time() - idle_s)).rowcount

    def _refilled(self, per_minute: int, now: float):
        """The bucket's level at `now`, as a SQL expression over its row."""
        table = self.table
        return _capped(table.c.level + (now - table.c.updated) * (per_minute / 60.0),
                       per_minute)


def _capped(level, per_minute: int):
    return case((level > float(per_minute), float(per_minute)), else_=level)


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

