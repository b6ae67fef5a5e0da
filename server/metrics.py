"""Prometheus metrics of the server, in a registry of their own."""

from __future__ import annotations

import collections
import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """One finished generation, kept for the dashboard's windowed quantiles."""

    request_class: str
    ttft_s: float | None
    tpot_s: float | None
    met_slo: bool | None  # RT judged (`ChatService._record_rt_slo`): met both its targets


class ServerMetrics:
    def __init__(self, max_finished: int = 10_000) -> None:
        """`max_finished`: finished requests kept until the dashboard takes them."""
        self.finished: collections.deque[FinishedRequest] = collections.deque(
            maxlen=max_finished)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "antiphon_requests", "Generations by API, class and outcome (one per choice: "
            "a request with n=2 counts 2)",
            ["api", "request_class", "outcome"], registry=r)
        self.ttft = Histogram(
            "antiphon_ttft_seconds", "Time to first token", ["request_class"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "antiphon_tpot_seconds", "Time per output token after the first", ["request_class"],
            buckets=_TPOT_BUCKETS, registry=r)
        self.normalized_latency = Histogram(
            "antiphon_normalized_latency_seconds",
            "Request latency (arrival to last token) per output token", ["request_class"],
            buckets=(*_TPOT_BUCKETS, 2.56, 5.12, 10.24), registry=r)
        self.rt_slo = Counter(
            "antiphon_rt_slo_requests",
            "RT requests by target (ttft, tpot) and whether they met it: completed ones, ones "
            "the engine failed (missed), and ones cancelled past a target; attainment is "
            "met=true over both", ["target", "met"], registry=r)
        self.prompt_tokens = Counter(
            "antiphon_prompt_tokens", "Prompt tokens submitted (per choice, as the engine "
            "runs each)", ["request_class"], registry=r)
        self.cached_prompt_tokens = Counter(
            "antiphon_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
            ["request_class"], registry=r)
        self.generation_tokens = Counter(
            "antiphon_generation_tokens", "Output tokens generated", ["request_class"],
            registry=r)
        self.inflight = Gauge(
            "antiphon_inflight_requests", "Generations in flight", ["request_class"], registry=r)
        self.connections = Gauge(
            "antiphon_websocket_connections", "Open websocket connections", registry=r)
        self.advisories = Counter(
            "antiphon_advisories", "Advisories kept and sent to the engine, by source (repeats: antiphon_advisory_repeats_total)", ["source"],
            registry=r)
        self.advisory_repeats = Counter(
            "antiphon_advisory_repeats",
            "Advisories that repeated their session's last one (unchanged conversation, "
            "within --advisory-repeat-interval-s): answered without the engine, by source",
            ["source"], registry=r)
        self.batch_items = Counter(
            "antiphon_batch_items", "Batch (BE) items answered, by outcome (completed, failed)",
            ["outcome"], registry=r)
        self.batch_queue = Gauge(
            "antiphon_batch_queue_items",
            "Batch (BE) items of in-progress batches waiting for a slot on the engine",
            registry=r)
        self.errors = Counter(
            "antiphon_errors", "Errors answered to clients, by code", ["code"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 when it has none yet)."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def total(self, name: str) -> float:
        """The sum of a sample over all its label values (0 when it has none yet)."""
        return sum(s.value for metric in self.registry.collect() for s in metric.samples
                   if s.name == name)

    def take_finished(self) -> list[FinishedRequest]:
        """The requests finished since the last call, oldest first."""
        taken = list(self.finished)
        self.finished.clear()
        return taken
