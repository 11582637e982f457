"""The consumer's Prometheus metrics (prometheus_client): a few counters and gauges, each with its HELP, no
per-token labels. One registry per app (tests run several in one process); what lives in Redis (the queue,
the aborted-generation totals) is read at each scrape and written with the same library (consumer.views.ops).
Names are part of the deployment: deploy/prometheus/rsb-alerts.yml and deploy/grafana query them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric

# No ``<name>_created`` series beside each counter: nothing here reads them, and they double every scrape.
disable_created_metrics()

#: The exposition format's content type (text 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Families:
    """Metric families built for one scrape, as a collector (``generate_latest`` only calls ``collect``)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_text, labels, registry=self.registry)

        self.streams_created = counter("rsb_streams_created_total", "streams created (one generation enqueued)")
        self.creates_replayed = counter(
            "rsb_creates_replayed_total", "creates of an existing id with an identical request (nothing enqueued)")
        self.creates_rejected = counter(
            "rsb_creates_rejected_total", "creates refused with 429 (queue full, a caller's share or create rate)")
        self.storage_full = counter(
            "rsb_storage_full_total", "writes Redis refused for lack of memory (maxmemory), answered 507 storage_full")
        self.budget_exceeded = counter(
            "rsb_budget_exceeded_total", "creates refused because the API key's token budget is spent or reserved "
            "(429 budget_exceeded; also in rsb_creates_rejected_total)")
        self.storage_quota = counter(
            "rsb_storage_quota_rejected_total",
            "writes refused because the caller holds its storage quota (429 storage_quota)")
        self.webhooks_delivered = counter("rsb_webhooks_delivered_total", "webhook events delivered (a 2xx answer)")
        self.webhooks_retried = counter(
            "rsb_webhooks_retried_total", "webhook deliveries that failed and were scheduled again (same webhook-id)")
        self.webhooks_given_up = counter(
            "rsb_webhooks_given_up_total", "webhook events dropped after a day of failed deliveries")
        self.cancels = counter("rsb_cancels_total", "cancel requests")
        self.reads = counter("rsb_reads_total", "event reads (SSE) started")
        self.resumes = counter("rsb_resumes_total", "event reads that resumed after an event id")
        self.events_sent = counter("rsb_events_sent_total", "events written to SSE readers")
        self.ds_requests = counter("rsb_ds_requests_total", "Durable Streams requests (/v1/stream/), by HTTP method",
                                   ("method",))

    def gauge(self, name: str, fn: Callable[[], float], help_text: str) -> None:
        """A gauge read from ``fn`` at each scrape."""
        Gauge(name, help_text, registry=self.registry).set_function(fn)

    def render(self, scraped: Iterable[Metric] = ()) -> bytes:
        """The exposition text: this pod's metrics, then ``scraped`` (families read for this scrape)."""
        return generate_latest(self.registry) + generate_latest(_Families(scraped))
