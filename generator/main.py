"""The ``rsb generator`` process: build the engine, connect, run the worker until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from broker import runtime, telemetry
from broker.errors import StoreTransient
from broker.redis.connection import connect, connect_blocking
from broker.redis.eviction import check_eviction_policy
from broker.streams.job_store import JobStore
from generator.engines import Engine, build_engine
from generator.metrics import serve_metrics
from generator.settings import GeneratorSettings
from generator.worker import Worker

log = logging.getLogger("rsb.generator")


async def serve(settings: GeneratorSettings, engine: Engine) -> None:
    b = settings.broker
    redis = connect(b.url, max_connections=4, retries=1, cluster=b.cluster)
    # One blocking BLPOP per hash slot waited on (one on a standalone server) plus the cancel listener.
    blocking = connect_blocking(b.url, max_connections=b.partitions + 1, cluster=b.cluster)
    store = JobStore(redis, b.partitions, durability_level=b.durability, replica_wait_ms=b.replica_wait_ms)
    worker = Worker(settings, engine, store, blocking)
    metrics_server = None
    if settings.metrics_port:
        metrics_server = await serve_metrics(worker.metrics, settings.metrics_host, settings.metrics_port)
    task = asyncio.create_task(worker.run())
    loop = asyncio.get_running_loop()
    grace: list[asyncio.TimerHandle] = []

    def on_signal() -> None:
        if worker.stopping:  # second signal: hand the job over now
            worker.hand_over()
            return
        log.info("stopping: no new jobs; finishing the one in flight", extra={"grace_s": settings.shutdown_grace_s})
        worker.request_stop()
        # Past the grace period the job goes back to the queue, and another worker continues it from the
        # text already appended.
        grace.append(loop.call_later(settings.shutdown_grace_s, worker.hand_over))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    # Announced before "ready": a create naming this model, sent once a supervisor saw the line, finds it listed.
    with contextlib.suppress(StoreTransient):  # else the announcer's loop tries again
        await worker.announce_now()
    log.info("generator ready", extra={"worker_id": worker.worker_id, "model": engine.name,
                                           "stack": runtime.stack()})
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        for h in grace:
            h.cancel()
        if metrics_server is not None:
            metrics_server.close()
        await store.aclose()
        await redis.aclose()
        await blocking.aclose()
        engine.close()


# The inference thread needs the GIL between llama.cpp calls (sampling, detokenizing); with CPython's
# default 5 ms switch interval it can wait that long behind the event loop's Redis work for every token.
GIL_SWITCH_INTERVAL_S = 0.0005


def run_generator(settings: GeneratorSettings) -> None:
    # allkeys-* could evict the job queues and unfinished streams: refused before any model loads.
    check_eviction_policy(settings.broker.url, cluster=settings.broker.cluster, role="rsb generator")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    tracing = telemetry.setup("rsb-generator")  # TelemetryMissing: one line, said by rsb.cli
    try:
        engine = build_engine(settings.engine)
        runtime.tune_gc()
        runtime.run(serve(settings, engine))
    finally:
        tracing.shutdown()
