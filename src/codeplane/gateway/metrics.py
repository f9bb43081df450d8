"""Gateway metrics on the app's Prometheus registry.

Counters and histograms are updated per request; deployment state (circuit, cooldown, ramp,
outstanding) is read at scrape time by a collector, so it costs nothing per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from codeplane.core.metrics import LATENCY_BUCKETS
from codeplane.gateway.deployment import OPEN, Deployment

FAST_BUCKETS = (0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry,
                 deployments: Callable[[], Iterable[Deployment]]) -> None:
        self.requests = Counter("codeplane_gateway_requests_total",
                                "Attempts per deployment by outcome",
                                ["deployment", "model", "outcome"], registry=registry)
        self.latency = Histogram("codeplane_gateway_latency_seconds",
                                 "Upstream time to first token (streams) or response",
                                 ["deployment"], buckets=FAST_BUCKETS, registry=registry)
        self.queue_wait = Histogram("codeplane_gateway_queue_wait_seconds",
                                    "Time waiting for admission", ["model", "priority"],
                                    buckets=FAST_BUCKETS, registry=registry)
        self.tokens = Counter("codeplane_gateway_tokens_total", "Tokens per deployment",
                              ["deployment", "direction"], registry=registry)
        self.shed = Counter("codeplane_gateway_shed_total", "Requests refused at admission",
                            ["priority", "reason"], registry=registry)
        self.stream_errors = Counter("codeplane_gateway_stream_errors_total",
                                     "Streams ended by an in-band error after the first token",
                                     ["deployment"], registry=registry)
        registry.register(_StateCollector(deployments))


class _StateCollector(Collector):
    def __init__(self, deployments: Callable[[], Iterable[Deployment]]) -> None:
        self.deployments = deployments

    def collect(self):
        now = time.monotonic()
        cooling = GaugeMetricFamily("codeplane_gateway_cooldown_seconds",
                                    "Seconds until an open circuit allows a probe",
                                    labels=["deployment"])
        state = GaugeMetricFamily("codeplane_gateway_circuit_open",
                                  "1 while the deployment's circuit is open (cooling down)",
                                  labels=["deployment"])
        ramp = GaugeMetricFamily("codeplane_gateway_slow_start_ramp",
                                 "Share of full weight while slow-starting (1 = full)",
                                 labels=["deployment"])
        busy = GaugeMetricFamily("codeplane_gateway_outstanding",
                                 "Requests in flight per deployment", labels=["deployment"])
        for dep in self.deployments():
            cooling.add_metric([dep.id], max(0.0, dep.open_until - now) if dep.cooling(now)
                               else 0.0)
            state.add_metric([dep.id], 1.0 if dep.state == OPEN and dep.cooling(now) else 0.0)
            ramp.add_metric([dep.id], dep.ramp(now))
            busy.add_metric([dep.id], dep.outstanding)
        yield from (cooling, state, ramp, busy)
