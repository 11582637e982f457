"""``python3 -m bench.paced_generator --redis-url URL --tokens-per-s 20 --workers N``

N unmodified ``generator.worker.Worker`` loops in one process, each driving the deterministic
``PacedEngine`` (a real rsb generator runs one Worker per process because one llama.cpp context runs one
generation at a time; a paced engine has no such limit, so one process can stand in for N of them).
Each Worker gets what ``generator.main.serve`` gives one: the shared command client, and a blocking
client with room for its BLPOP and its cancel listener.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import faulthandler
import logging
import os
import signal

from redis.asyncio import BlockingConnectionPool, Redis

from bench.paced_engine import PacedEngine
from bench.procs import raise_nofile
from broker import runtime, telemetry
from broker.logs import setup_logging
from broker.redis.connection import connect
from broker.settings import BrokerSettings
from broker.streams.job_store import JobStore
from generator.settings import GeneratorSettings
from generator.worker import Worker

log = logging.getLogger("rsb.bench.paced")


def blocking_client(url: str, connections: int) -> Redis:
    """Like ``broker.redis.connection.connect_blocking`` (no socket timeout) with room for ``connections``."""
    pool = BlockingConnectionPool.from_url(url, max_connections=connections, timeout=5.0, socket_timeout=None,
                                           socket_connect_timeout=2.0, socket_keepalive=True)
    return Redis(connection_pool=pool)


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    # Worker runs each generation's engine loop with asyncio.to_thread: one thread per generation.
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=args.workers + 8))
    settings = GeneratorSettings(broker=BrokerSettings(redis_url=args.redis_url, partitions=args.partitions),
                                 lease_s=args.lease_s, shutdown_grace_s=1.0, concurrency=args.workers)
    redis = connect(args.redis_url, max_connections=args.pool, retries=1)
    blocking = blocking_client(args.redis_url, args.partitions + 2)
    engine = PacedEngine(args.tokens_per_s, on_loop=not args.threaded)
    store = JobStore(redis, args.partitions, durability_level=args.durability)
    # One worker running --workers generations at once, as a worker driving an upstream server does; its
    # appends share pipelines (generator/appends.py).
    workers = [Worker(settings, engine, store, blocking)]
    tasks = [asyncio.create_task(w.run()) for w in workers]

    def on_signal() -> None:
        for w in workers:
            w.request_stop()
        loop.call_later(settings.shutdown_grace_s, lambda: [t.cancel() for t in tasks])

    def dump_tasks() -> None:  # SIGUSR2: where every task is awaiting, into a file, for diagnosis
        import io

        buf = io.StringIO()
        for t in asyncio.all_tasks():
            t.print_stack(file=buf)
        path = f"/tmp/rsb-paced-generator-tasks-{os.getpid()}.txt"
        with open(path, "w") as f:
            f.write(buf.getvalue())
        print(f"tasks written to {path}", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
    print(f"paced generator ready: {args.workers} workers at {args.tokens_per_s} tokens/s", flush=True)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
    finally:
        await redis.aclose()
        await blocking.aclose()


def main() -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.paced_generator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--tokens-per-s", type=float, default=20.0, help="tokens per second of each generation")
    p.add_argument("--workers", type=int, default=1, help="concurrent generations (Worker loops)")
    p.add_argument("--pool", type=int, default=16, help="command connections shared by the workers")
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--lease-s", type=float, default=10.0)
    p.add_argument("--durability", default="local", choices=("local", "replicated"))
    p.add_argument("--log-level", default="warning")
    p.add_argument("--threaded", action="store_true",
                   help="the paced engine in a thread per generation (as llama.cpp runs), not on the loop")
    args = p.parse_args()
    raise_nofile()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # thread stacks on demand, for diagnosis
    setup_logging(args.log_level)
    tracing = telemetry.setup("rsb-generator")  # as `rsb generator` does: off unless OTEL_* variables ask
    try:
        runtime.run(serve(args))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
