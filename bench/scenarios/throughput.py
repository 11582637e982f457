"""throughput: delivered events/s at saturation on one consumer process.

``--readers`` concurrent SSE readers (one load process, bare keep-alive HTTP/1.1 connections that count
event lines: ``bench.sseclient.RawConnection``) read whole finished streams of ``--events``
events from the start, over and over, for ``--duration-s``; events counted at the client.
Reference, same Redis and data: the raw redis-py read ceiling, one Python process reading the same
entries with XRANGE (pages of 512, the consumer's page) with the same concurrency and pool size (8).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool

from bench import procs
from bench.loadproc import Control
from bench.prefill import prefill
from bench.report import goal_row, print_goals, table
from bench.sseclient import RawConnection
from bench.stats import ratio
from broker import runtime
from broker.streams.keys import StreamKeys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=16, help="finished streams to read (default 16)")
    p.add_argument("--events", type=int, default=4096, help="events per stream (default 4096)")
    p.add_argument("--readers", type=int, default=64, help="concurrent readers (default 64)")
    p.add_argument("--duration-s", type=float, default=10.0)


async def load_sse(ctl: Control, base: str, sids: list[str], readers: int, duration_s: float) -> dict[str, Any]:
    counts = [0] * readers
    end = time.monotonic() + duration_s

    host, port = base.removeprefix("http://").split(":")

    async def reader(i: int) -> None:
        # A bare keep-alive HTTP/1.1 connection counting event lines (httpx's per-chunk Python work made the
        # load process, not the server, what limited this run on 2 cores).
        conn = RawConnection(host, int(port))

        def count(n: int) -> bool:
            counts[i] += n
            return time.monotonic() < end

        try:
            n = i
            while time.monotonic() < end:
                sid = sids[n % len(sids)]
                n += 1
                await conn.get_counting(f"/v1/streams/{sid}/events", b"\nevent: ", count)
        finally:
            await conn.close()

    ctl.mark("start")
    t0, c0 = time.monotonic(), time.process_time()
    await asyncio.gather(*(reader(i) for i in range(readers)))
    wall = time.monotonic() - t0
    return {"events": sum(counts), "wall_s": wall, "events_per_s": sum(counts) / wall,
            "load_cores": (time.process_time() - c0) / wall}


async def load_xrange(ctl: Control, redis_url: str, sids: list[str], readers: int,
                      duration_s: float) -> dict[str, Any]:
    runtime.tune_gc()  # the consumer's collector settings: the ceiling is measured on equal terms
    r = aioredis.Redis(connection_pool=BlockingConnectionPool.from_url(redis_url, max_connections=8))
    keys = [StreamKeys.of(uuid.UUID(s), 1).events for s in sids]
    counts = [0] * readers
    end = time.monotonic() + duration_s

    async def reader(i: int) -> None:
        n = i
        while time.monotonic() < end:
            key = keys[n % len(keys)]
            n += 1
            start = "-"
            while time.monotonic() < end:
                page = await r.xrange(key, min=start, max="+", count=512)
                counts[i] += len(page)
                if len(page) < 512:
                    break
                start = "(" + page[-1][0].decode()

    t0 = time.monotonic()
    await asyncio.gather(*(reader(i) for i in range(readers)))
    wall = time.monotonic() - t0
    await r.aclose()
    return {"events": sum(counts), "wall_s": wall, "events_per_s": sum(counts) / wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"streams": args.streams, "events": args.events, "readers": args.readers,
                                      "duration_s": args.duration_s}}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        sids = [s["id"] for s in prefill(server.url, args.streams, args.events)]
        out["rsb"] = procs.run_load_measuring_cpu(
            "bench.scenarios.throughput:load_sse",
            {"base": base, "sids": sids, "readers": args.readers, "duration_s": args.duration_s},
            [consumer.pid], args.duration_s + 120)
        consumer.stop()
        out["reference"] = procs.run_load("bench.scenarios.throughput:load_xrange",
                                          {"redis_url": server.url, "sids": sids, "readers": args.readers,
                                           "duration_s": args.duration_s})
    rsb, ref = out["rsb"]["events_per_s"], out["reference"]["events_per_s"]
    out["ratio_to_reference"] = r = ratio(rsb, ref)
    print(table(f"\n== throughput: {args.readers} readers of {args.events}-event streams",
                ["path", "events/s", "note"],
                [["rsb SSE, one consumer", rsb, f"consumer {out['rsb']['consumer_cores']:.2f} cores, "
                  f"load process {out['rsb']['load_cores']:.2f} cores"],
                 ["reference: redis-py XRANGE, one process", ref, "same pages (512), pool of 8"]]))
    out["goals"] = {"ge_70pct_of_reference": r >= 0.7}
    print_goals("throughput", [goal_row("rsb / reference", r * 100, ">= 70%", r >= 0.7, "%")])
    return out
