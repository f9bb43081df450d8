"""One deployment's live state: load, latency, circuit breaker, slow start, rpm/tpm.

Circuit breaker: `allowed_fails` consecutive failures, a `failure_rate` share of failures
over at least `failure_window` requests in the last minute, or a 429 open the circuit for
`cooldown_s` (or the upstream's Retry-After if longer). When that passes the circuit is
half-open: exactly one probe request may go; success closes it, failure re-opens it.

Slow start: after a recovery the deployment's routing weight and parallel cap ramp linearly
from 5% to full over `slow_start_s`, so a backend that just came back warm-up-cold is not
flattened by the whole queue at once.
"""

from __future__ import annotations

import math
import time
from collections import deque

from codeplane.config.gateway import DeploymentConfig, RouterConfig
from codeplane.gateway.admission import TokenBucket
from codeplane.gateway.providers.base import Provider, UpstreamError

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
MIN_RAMP = 0.05
LATENCY_FLOOR_S = 0.025


class Deployment:
    def __init__(self, cfg: DeploymentConfig, provider: Provider, policy: RouterConfig,
                 deployment_id: str, timeouts: bool = True) -> None:
        self.cfg, self.provider, self.policy, self.id = cfg, provider, policy, deployment_id
        self.timeout_s = cfg.timeout_s if timeouts else None
        self.first_token_s = (cfg.first_token_timeout_s or policy.first_token_timeout_s
                              if timeouts else None)
        self.idle_s = policy.stream_idle_timeout_s if timeouts else None
        self.outstanding = 0
        self.latency: float | None = None  # EWMA of time to first token (or whole response)
        self.state = CLOSED
        self.open_until = 0.0
        self.probing = False
        self.consecutive = 0
        self.window: deque[tuple[float, bool]] = deque()
        self.recovered_at: float | None = None
        self.last_error = ""
        self.rpm = TokenBucket(cfg.rpm) if cfg.rpm else None
        self.tpm = TokenBucket(cfg.tpm) if cfg.tpm else None

    # -- routing -------------------------------------------------------------------------

    def ramp(self, now: float) -> float:
        if self.recovered_at is None or self.policy.slow_start_s <= 0:
            return 1.0
        share = (now - self.recovered_at) / self.policy.slow_start_s
        if share >= 1:
            self.recovered_at = None
            return 1.0
        return max(MIN_RAMP, share)

    def parallel_cap(self, now: float) -> float:
        ramp = self.ramp(now)
        if ramp >= 1:
            return self.cfg.max_parallel or math.inf
        return max(1, math.ceil(ramp * (self.cfg.max_parallel or self.policy.slow_start_parallel)))

    def cooling(self, now: float) -> bool:
        return self.state == OPEN and now < self.open_until

    def capacity(self, now: float) -> float:
        """How many requests this deployment may hold at once right now."""
        if self.cooling(now):
            return 0
        if self.state != CLOSED:  # half-open (or about to be): one probe at a time
            return 1
        return self.parallel_cap(now)

    def available(self, now: float) -> bool:
        if self.state == OPEN:
            if now < self.open_until:
                return False
            self.state, self.probing = HALF_OPEN, False
        if self.state == HALF_OPEN:
            return not self.probing
        if self.outstanding >= self.parallel_cap(now):
            return False
        if self.rpm and self.rpm.wait_s() > 0:
            return False
        return not (self.tpm and self.tpm.wait_s(0) > 0)

    def weight(self, now: float, default_latency: float) -> float:
        """Least outstanding first, then fastest; scaled down while slow-starting."""
        # The floor keeps sub-millisecond jitter from steering traffic between equals.
        latency = (self.latency or default_latency) + LATENCY_FLOOR_S
        return self.cfg.weight * self.ramp(now) / (latency * (1 + self.outstanding) ** 2)

    # -- accounting ----------------------------------------------------------------------

    def begin(self) -> None:
        self.outstanding += 1
        if self.state == HALF_OPEN:
            self.probing = True
        if self.rpm:
            self.rpm.take(1)

    def end(self, tokens: int = 0) -> None:
        self.outstanding -= 1
        if self.tpm and tokens:
            self.tpm.take(tokens)

    def healthy(self, latency: float | None) -> None:
        now = time.monotonic()
        if latency is not None:
            self.latency = latency if self.latency is None else \
                self.latency + 0.2 * (latency - self.latency)
        self.consecutive = 0
        self._note(now, True)
        if self.state != CLOSED:
            self.state, self.probing = CLOSED, False
            self.recovered_at = now if self.policy.slow_start_s > 0 else None

    def unhealthy(self, error: UpstreamError) -> None:
        now = time.monotonic()
        self.last_error = f"HTTP {error.status}: {error.message}"[:300]
        self.consecutive += 1
        self._note(now, False)
        fails = sum(1 for _, ok in self.window if not ok)
        rate_tripped = (len(self.window) >= self.policy.failure_window
                        and fails / len(self.window) >= self.policy.failure_rate)
        if (self.state == HALF_OPEN or error.status == 429 or rate_tripped
                or self.consecutive >= self.policy.allowed_fails):
            self._open(now, max(self.policy.cooldown_s, error.retry_after or 0))

    def _note(self, now: float, ok: bool) -> None:
        self.window.append((now, ok))
        while self.window and (now - self.window[0][0] > 60 or len(self.window) > 100):
            self.window.popleft()

    def _open(self, now: float, seconds: float) -> None:
        self.state, self.open_until, self.probing = OPEN, now + seconds, False
        self.consecutive = 0
        self.window.clear()
        self.recovered_at = None

    def status(self, now: float) -> dict:
        state = self.state
        if state == OPEN and now >= self.open_until:
            state = HALF_OPEN
        return {"id": self.id, "model": self.cfg.name, "provider": self.cfg.provider,
                "upstream": self.cfg.address,
                "state": state, "cooldown_s": round(max(0.0, self.open_until - now), 2)
                if state == OPEN else 0.0,
                "ramp": round(self.ramp(now), 3), "outstanding": self.outstanding,
                "latency_ms": round(self.latency * 1000, 1) if self.latency else None,
                "last_error": self.last_error}
