"""``GET /metrics``: the vLLM gauges the rest of vime reads, in Prometheus text format.

The router's control plane drains an engine by watching ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` (sequences in the batch, sequences queued — held ones included);
the reference engine serves them under vLLM's names and labels, plus the generated-token and
finished-request counters (the rollout manager's requests per engine) and vLLM's sleep-state
gauge, read from the engine core at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine_core import EngineCore


class EngineCollector(Collector):
    """Reads the engine core's counters whenever /metrics is scraped."""

    def __init__(self, app: FastAPI, model_name: str) -> None:
        self.app = app
        self.labels = ["model_name", "engine"]
        self.values = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        core: EngineCore | None = getattr(self.app.state, "core", None)
        if core is None:
            return
        state = core.state()
        gauges = {
            "vllm:num_requests_running": ("Number of requests in model execution batches.", state["running"]),
            "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", state["waiting"]),
            "vllm:engine_sleep_state": (
                "Engine sleep state (1 = asleep or paused).",
                int(core.is_sleeping()),
            ),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=self.labels)
            g.add_metric(self.values, float(value))
            yield g
        c = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=self.labels
        )
        c.add_metric(self.values, float(state["generated_tokens"]))
        yield c
        done = CounterMetricFamily("vllm:request_success", "Count of finished requests.", labels=self.labels)
        done.add_metric(self.values, float(state["finished_requests"]))
        yield done


def add_metrics_route(app: FastAPI, model_name: str) -> None:
    registry = CollectorRegistry()
    registry.register(EngineCollector(app, model_name))

    @app.get("/metrics")
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
