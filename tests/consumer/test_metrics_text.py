"""consumer.metrics and generator.metrics: valid Prometheus text (prometheus_client's own parser reads it back),
a HELP for every family, labels as labels (never built into a name), and every name the deployment's alerts and
dashboard query (tests/deploy checks those against the deploy files)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from consumer.metrics import Metrics
from generator.metrics import GeneratorMetrics


def _families(text: bytes) -> dict[str, tuple[str, str]]:
    return {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(text.decode())}


def test_the_consumer_writes_every_family_with_its_help_and_labels_as_labels() -> None:
    m = Metrics()
    m.gauge("rsb_connected_readers", lambda: 2, "SSE readers tailing a stream on this pod")
    m.ds_requests.labels("PUT").inc()
    m.events_sent.inc(3)
    aborted = CounterMetricFamily("rsb_aborted_streams", "aborted generations: streams, by reason", labels=["reason"])
    aborted.add_metric(["client"], 1)
    text = m.render([aborted])
    families = _families(text)
    assert all(help_text for _, help_text in families.values()), families
    for name in ("rsb_streams_created", "rsb_creates_replayed", "rsb_creates_rejected", "rsb_cancels", "rsb_reads",
                 "rsb_resumes", "rsb_events_sent", "rsb_ds_requests", "rsb_aborted_streams"):
        assert families[name][0] == "counter", name
    assert families["rsb_connected_readers"][0] == "gauge"
    lines = text.decode().splitlines()
    assert 'rsb_ds_requests_total{method="PUT"} 1.0' in lines and "rsb_events_sent_total 3.0" in lines
    assert 'rsb_aborted_streams_total{reason="client"} 1.0' in lines
    assert not any(line.split("{")[0].split(" ")[0].endswith("_created") for line in lines)  # no timestamp series


def test_the_generator_writes_counters_a_gauge_and_histograms_with_help() -> None:
    g = GeneratorMetrics()
    g.finished("done", {"ttft_ms": 12.0, "tpot_ms": 3.0}, 5)
    g.finished("cancelled", {"ttft_ms": None, "tpot_ms": None}, 2)
    text = g.render()
    families = _families(text)
    assert all(help_text for _, help_text in families.values()), families
    assert families["rsb_generator_ttft_ms"][0] == "histogram" and families["rsb_generator_running"][0] == "gauge"
    lines = text.decode().splitlines()
    assert 'rsb_generator_jobs_total{status="cancelled"} 1.0' in lines
    assert "rsb_generator_tokens_total 7.0" in lines and "rsb_generator_tokens_wasted_total 2.0" in lines
    assert 'rsb_generator_ttft_ms_bucket{le="25.0"} 1.0' in lines and "rsb_generator_ttft_ms_count 1.0" in lines
