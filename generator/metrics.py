"""The generator's Prometheus metrics (prometheus_client), served by a tiny HTTP endpoint (``--metrics-port``).

Updated once per generation (never per token): jobs by outcome, tokens generated and tokens generated
for answers that were then aborted, and TTFT/TPOT histograms. The endpoint is served from the worker's own
event loop, not from prometheus_client's server thread: it is the generators' startup and liveness probe
(deploy/kubernetes), so a worker whose loop is stuck must stop answering it."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from broker import genai, telemetry
from broker.scrape import serve_scrapes
from broker.streams.records import Claim
from generator.telemetry import error_type, operation

# No ``<name>_created`` series beside each counter and histogram: nothing reads them.
disable_created_metrics()

TTFT_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
TPOT_BUCKETS_MS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_WAIT_BUCKETS_S = genai.QUEUE_WAIT.buckets
# The attributes (labels) of the GenAI histograms, in this order (then error.type or gen_ai.token.type).
SERVED_LABELS = (genai.OPERATION, genai.PROVIDER, genai.REQUEST_MODEL, genai.RESPONSE_MODEL)


class GeneratorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Counter("rsb_generator_jobs_total", "generations this worker ended, by final status", ["status"],
                            registry=r)
        self.tokens_generated = Counter("rsb_generator_tokens_total", "tokens this worker generated", registry=r)
        self.tokens_wasted = Counter("rsb_generator_tokens_wasted_total",
                                     "tokens generated for answers that were then aborted", registry=r)
        self.storage_full = Counter(
            "rsb_generator_storage_full_total",
            "writes Redis refused for lack of memory (maxmemory), each retried until it succeeded", registry=r)
        self.running = Gauge("rsb_generator_running", "generations in flight on this worker", registry=r)
        self.parked = Gauge("rsb_generator_parked", "generations of this worker parked without a slot while a write "
                            "waits (no replica acknowledged it, or its shard is down: generator.slots)", registry=r)
        self.ttft = Histogram("rsb_generator_ttft_ms", "time from claim to first token, in ms", registry=r,
                              buckets=TTFT_BUCKETS_MS)
        self.queue_wait = Histogram(
            "rsb_generator_queue_wait_seconds", "time from create to this worker's claim of a job's first attempt, by "
            "model and service tier", ["model", "tier"], registry=r, buckets=QUEUE_WAIT_BUCKETS_S)
        self.takeovers = Counter("rsb_generator_takeovers_total", "jobs this worker continued after another attempt "
                                 "(a worker that died, stalled past its lease or handed the job over)", registry=r)
        self.tpot = Histogram("rsb_generator_tpot_ms", "time per output token after the first, in ms (one stream's "
                              "tokens/s is 1000 / this)", registry=r, buckets=TPOT_BUCKETS_MS)
        self.batch_sequences = Histogram(
            "rsb_generator_batch_sequences", "sequences in each batched decoding step (--parallel)", registry=r,
            buckets=BATCH_BUCKETS)
        self.step_seconds = Histogram(
            "rsb_generator_step_seconds", "time of each batched decoding step: every running sequence's next token "
            "and a chunk of the prompts being prefilled", registry=r, buckets=STEP_BUCKETS_S)
        self.prefill_tokens = Counter("rsb_generator_prefill_tokens_total",
                                      "prompt tokens prefilled in batched steps", registry=r)

        # The GenAI conventions' model-server histograms (broker.genai), here under the names OpenTelemetry's Prometheus
        # translation gives them, and sent over OTLP too when metrics are exported (broker.telemetry).
        labels = [genai.label(a) for a in SERVED_LABELS]
        self.genai = {h.name: Histogram(genai.prometheus_name(h), h.description, labels, registry=r, buckets=h.buckets)
                      for h in (genai.TIME_TO_FIRST_TOKEN, genai.TIME_PER_OUTPUT_TOKEN)}
        self.genai[genai.REQUEST_DURATION.name] = Histogram(
            genai.prometheus_name(genai.REQUEST_DURATION), genai.REQUEST_DURATION.description,
            [*labels, genai.label(genai.ERROR_TYPE)], registry=r, buckets=genai.REQUEST_DURATION.buckets)
        self.genai[genai.TOKEN_USAGE.name] = Histogram(
            genai.prometheus_name(genai.TOKEN_USAGE), genai.TOKEN_USAGE.description,
            [*labels, genai.label(genai.TOKEN_TYPE)], registry=r, buckets=genai.TOKEN_USAGE.buckets)
        meter = telemetry.METER
        self.otel: dict[str, Any] = {} if meter is None else {
            h.name: meter.create_histogram(h.name, unit=h.unit, description=h.description,
                                           explicit_bucket_boundaries_advisory=list(h.buckets))
            for h in (genai.TIME_TO_FIRST_TOKEN, genai.TIME_PER_OUTPUT_TOKEN, genai.REQUEST_DURATION,
                      genai.TOKEN_USAGE, genai.QUEUE_WAIT)}

    def _observe(self, h: genai.Histogram, value: float, attributes: dict[str, str]) -> None:
        prom = self.genai.get(h.name)
        if prom is not None:
            prom.labels(*attributes.values()).observe(value)
        otel = self.otel.get(h.name)
        if otel is not None:  # no error.type on a success (the conventions' attribute is for errors)
            otel.record(value, {k: v for k, v in attributes.items() if v != ""})

    def served(self, claim: Claim, response_model: str, status: str, code: str, usage: dict[str, Any],
               elapsed_s: float) -> None:
        """A generation's terminal event landed, ``elapsed_s`` after this attempt's claim: the GenAI histograms.
        Durations count from the create (the queue wait included, as the conventions' server TTFT does); the first
        token's time only for a first attempt's (a continuation's first token came from an earlier attempt)."""
        attrs = {genai.OPERATION: operation(claim.request), genai.PROVIDER: genai.PROVIDER_RSB,
                 genai.REQUEST_MODEL: claim.model, genai.RESPONSE_MODEL: response_model}
        waited = max(0.0, claim.waited_s)
        if status == "done":
            if usage.get("ttft_ms") is not None and claim.attempts == 1:
                self._observe(genai.TIME_TO_FIRST_TOKEN, waited + float(usage["ttft_ms"]) / 1000, attrs)
            if usage.get("tpot_ms") is not None:
                self._observe(genai.TIME_PER_OUTPUT_TOKEN, float(usage["tpot_ms"]) / 1000, attrs)
        self._observe(genai.REQUEST_DURATION, waited + elapsed_s, {**attrs, genai.ERROR_TYPE: error_type(status, code)})
        for kind, field in ((genai.INPUT, "prompt_tokens"), (genai.OUTPUT, "completion_tokens")):
            self._observe(genai.TOKEN_USAGE, int(usage.get(field) or 0), {**attrs, genai.TOKEN_TYPE: kind})

    def batch_step(self, sequences: int, prefilled: int, seconds: float) -> None:
        """One batched decoding step (called from the engine's batcher thread: prometheus_client locks)."""
        self.batch_sequences.observe(sequences)
        self.step_seconds.observe(seconds)
        if prefilled:
            self.prefill_tokens.inc(prefilled)

    def claimed(self, model: str, tier: str, attempts: int, waited_s: float) -> None:
        if attempts == 1:
            self.queue_wait.labels(model, tier).observe(max(0.0, waited_s))
            otel = self.otel.get(genai.QUEUE_WAIT.name)
            if otel is not None:
                otel.record(max(0.0, waited_s), {genai.REQUEST_MODEL: model, genai.TIER: tier})
        else:
            self.takeovers.inc()

    def finished(self, status: str, usage: dict[str, Any], generated_here: int) -> None:
        """One generation ended. ``generated_here``: tokens this worker computed for it (not earlier attempts)."""
        self.jobs.labels(status).inc()
        self.tokens_generated.inc(generated_here)
        if status != "done":
            self.tokens_wasted.inc(generated_here)
        if usage.get("ttft_ms") is not None:
            self.ttft.observe(float(usage["ttft_ms"]))
        if usage.get("tpot_ms") is not None:
            self.tpot.observe(float(usage["tpot_ms"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(metrics: GeneratorMetrics, host: str, port: int) -> asyncio.Server:
    """GET /metrics on a port of its own (broker.scrape), from this worker's loop."""

    async def render() -> bytes:
        return metrics.render()

    return await serve_scrapes(render, host, port)
