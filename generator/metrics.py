"""The generator's Prometheus metrics (prometheus_client), served by a tiny HTTP endpoint (``--metrics-port``).

Updated once per generation (never per token): jobs by outcome, tokens generated and tokens generated
for answers that were then aborted, and TTFT/TPOT histograms. The endpoint is served from the worker's own
event loop, not from prometheus_client's server thread: it is the generators' startup and liveness probe
(deploy/kubernetes), so a worker whose loop is stuck must stop answering it."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from broker.scrape import serve_scrapes

# No ``<name>_created`` series beside each counter and histogram: nothing reads them.
disable_created_metrics()

TTFT_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
TPOT_BUCKETS_MS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_WAIT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


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

    def batch_step(self, sequences: int, prefilled: int, seconds: float) -> None:
        """One batched decoding step (called from the engine's batcher thread: prometheus_client locks)."""
        self.batch_sequences.observe(sequences)
        self.step_seconds.observe(seconds)
        if prefilled:
            self.prefill_tokens.inc(prefilled)

    def claimed(self, model: str, tier: str, attempts: int, waited_s: float) -> None:
        if attempts == 1:
            self.queue_wait.labels(model, tier).observe(max(0.0, waited_s))
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
