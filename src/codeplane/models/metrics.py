"""Engine metrics on the app's Prometheus registry: model worker crashes and restarts, and
the jobs waiting for each model.

Read from the engine at scrape time by a collector (as the gateway reads its deployments'
state), so the counts are the engine's own: one engine may outlive an app, and its workers
restart with no request in sight.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from codeplane.models.engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        restarts = CounterMetricFamily("codeplane_engine_worker_restarts",
                                       "Model worker processes started after a crash",
                                       labels=["model"])
        crashes = CounterMetricFamily("codeplane_engine_worker_crashes",
                                      "Model worker processes that died, by cause (signal "
                                      "or exit code)", labels=["model", "cause"])
        waiting = GaugeMetricFamily("codeplane_engine_jobs_waiting",
                                    "Jobs queued for a model behind the one it runs",
                                    labels=["model"])
        for model, status in self.engine.status().items():
            restarts.add_metric([model], status.restarts)
            for cause, count in status.crashes.items():
                crashes.add_metric([model, cause], count)
            waiting.add_metric([model], status.waiting)
        yield from (restarts, crashes, waiting)
