"""Prometheus metrics, one registry per app so several servers (or tests) never share counters.

Compartments register their own collectors on `app.state.metrics.registry`.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("codeplane_http_requests_total", "HTTP requests",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("codeplane_http_request_seconds", "HTTP request latency",
                                 ["route", "method"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.tokens = Counter("codeplane_tokens_total", "Tokens processed by local models",
                              ["model", "direction"], registry=self.registry)
        self.queue_wait = Histogram("codeplane_queue_wait_seconds",
                                    "Time a request waited for its model", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.cached_tokens = Counter("codeplane_prompt_tokens_cached_total",
                                     "Prompt tokens reused from the KV cache", ["model"],
                                     registry=self.registry)

    def record_generation(self, model: str, prompt: int, completion: int, cached: int,
                          waited_s: float) -> None:
        self.tokens.labels(model, "in").inc(prompt)
        self.tokens.labels(model, "out").inc(completion)
        self.cached_tokens.labels(model).inc(cached)
        self.queue_wait.labels(model).observe(waited_s)


def install(app: FastAPI, metrics: Metrics) -> None:
    app.add_middleware(_Measure, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    def _export() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _Measure:
    """Pure ASGI middleware: unlike `@app.middleware("http")` it does not wrap the response
    stream, so client disconnects reach the endpoint (which cancels generation)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = _route_template(scope)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.latency.labels(route, scope["method"]).observe(
                time.perf_counter() - start)


def _route_template(scope: Scope) -> str:
    """Label by route template (`/v1/agent/runs/{id}`), never raw paths: bounded cardinality.
    The router records the matched route in the scope while handling the request."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
