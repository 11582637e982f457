"""durability: what ``--durability replicated`` costs per token next to ``local``, in one run.

A primary and its replica (two redis-server processes on loopback), and for each level in turn one
``bench.paced_generator`` process (unmodified Workers over the deterministic paced engine) running
``--streams`` generations at once, ``--tokens-per-s`` each. This process creates the streams (through a StreamStore
at the same level, as a consumer would) and subscribes to their live channels, which is where a consumer's
hub hears of an event: at ``replicated`` only once a replica has it. Measured per level: the generator
process's CPU per token (µs), and delivery latency per token (produced by the engine -> published to
readers: p50 / p99 ms). Every stream is checked complete (each token once, in order).
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any

import orjson

from bench import procs
from bench.paced_engine import parse_tokens
from bench.report import table
from bench.sampling import CpuWindow
from bench.stats import percentile
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request.generation import RequestLimits, parse_create_body
from broker.streams.stream_store import StreamStore

LEVELS = ("local", "replicated")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=8, help="generations at once (default 8)")
    p.add_argument("--tokens", type=int, default=400, help="tokens per generation (default 400)")
    p.add_argument("--tokens-per-s", type=float, default=100.0, help="tokens/s of each generation (default 100)")


async def _measure(url: str, level: str, streams: int, tokens: int) -> dict[str, Any]:
    import time

    redis = connect(url)
    store = StreamStore(redis, durability_level=level)
    sids = [uuid.uuid4() for _ in range(streams)]
    pubsub = redis.pubsub()
    await pubsub.subscribe(*(store.keys(s).channel for s in sids))
    latencies: list[float] = []
    seen: dict[str, list[int]] = {str(store.keys(s).channel): [] for s in sids}
    ended = 0
    _, req = parse_create_body(orjson.dumps({"prompt": "bench", "max_tokens": tokens}),
                               RequestLimits(max_tokens=1 << 20, default_max_tokens=tokens))
    for sid in sids:
        await store.create(sid, req, model="paced", max_queue=0, retention_s=600)
    deadline = time.monotonic() + 120
    while ended < streams and time.monotonic() < deadline:
        msg: Any = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        if msg is None:
            continue
        now = time.time()
        _, etype, data = msg["data"].split(b"\n", 2)
        if etype == b"delta":
            for i, produced in parse_tokens(orjson.loads(data)["text"]):
                latencies.append((now - produced) * 1000)
                seen[msg["channel"].decode()].append(i)
        elif etype in (b"done", b"error", b"cancelled"):
            ended += 1
    await pubsub.aclose()
    await redis.aclose()
    complete = all(v == list(range(tokens)) for v in seen.values())
    return {"tokens": sum(len(v) for v in seen.values()), "complete": complete,
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    primary = RedisServer(extra_args=("--repl-diskless-sync-delay", "0")).start()
    replica = RedisServer(extra_args=("--replicaof", "127.0.0.1", str(primary.port))).start()
    out: dict[str, Any] = {"params": {"streams": args.streams, "tokens": args.tokens,
                                      "tokens_per_s": args.tokens_per_s, "engine": "paced (deterministic)",
                                      "redis": "primary + 1 replica, loopback"}}
    rows = []
    try:
        for level in LEVELS:
            with procs.procs() as started:
                gen = procs.start_paced_generator(primary.url, workers=args.streams, tokens_per_s=args.tokens_per_s,
                                                  extra=("--durability", level))
                started.append(gen)
                cpu = CpuWindow([gen.pid]).start()
                res = asyncio.run(_measure(primary.url, level, args.streams, args.tokens))
                cpu.stop()
            res["worker_cpu_us_per_token"] = cpu.cpu_s * 1e6 / max(1, res["tokens"])
            out[level] = res
            rows.append([level, res["worker_cpu_us_per_token"], res["p50_ms"], res["p99_ms"], res["tokens"],
                         res["complete"]])
    finally:
        replica.cleanup()
        primary.cleanup()
    print(table(f"\n== durability: {args.streams} streams x {args.tokens} tokens at {args.tokens_per_s:g} tokens/s, "
                "primary + replica", ["level", "worker CPU µs/token", "delivery p50 ms", "delivery p99 ms",
                                      "tokens", "complete"], rows))
    out["goals"] = {"complete": all(r[5] for r in rows)}
    return out
