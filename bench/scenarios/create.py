"""create: POST /v1/streams open-loop at ``--rate``/s (sent on schedule, never waiting for replies).

Latency runs from each request's scheduled send time (so a stall is not hidden by sending later) to
its response. No generator runs and the queue bound is off (``--max-queue 0``), so every create is a
201. Reference, same run: the same CREATE Lua script called straight from redis-py at the same
open-loop rate from one process (rsb's create without HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import orjson

from bench import procs
from bench.loadproc import Control
from bench.report import goal_row, print_goals, table
from bench.sseclient import RawConnection
from bench.stats import ratio, summarize
from broker.errors import RsbError
from broker.redis.connection import connect
from broker.request.generation import RequestLimits, parse_create_body
from broker.streams.stream_store import StreamStore


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=500.0, help="creates per second (default 500)")
    p.add_argument("--duration-s", type=float, default=10.0, help="default 10")
    p.add_argument("--connections", type=int, default=32,
                   help="client connections (requests beyond wait in the client, counted in latency)")


def body(sid: str) -> bytes:
    return orjson.dumps({"id": sid, "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
                         "max_tokens": 64})


async def _open_loop(rate: float, duration_s: float, senders: list[Any]) -> tuple[list[float], list[str], float]:
    """Put one request on the schedule every 1/rate s; ``senders`` (one per connection) take them as they
    come free. Latency counts from the scheduled time, so waiting for a free connection is included."""
    lat: list[float] = []
    errors: list[str] = []
    n = int(rate * duration_s)
    queue: asyncio.Queue[float | None] = asyncio.Queue()

    async def worker(send: Any) -> None:
        while (due := await queue.get()) is not None:
            try:
                ok, detail = await send()
            except Exception as e:
                ok, detail = False, repr(e)
            lat.append((time.monotonic() - due) * 1000)
            if not ok:
                errors.append(detail)

    workers = [asyncio.create_task(worker(s)) for s in senders]
    t0 = time.monotonic()
    max_lag = 0.0
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            max_lag = max(max_lag, -delay)
        queue.put_nowait(due)
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    return lat, errors, max_lag * 1000


async def load_http(ctl: Control, base: str, rate: float, duration_s: float, connections: int) -> dict[str, Any]:
    host, port = base.removeprefix("http://").split(":")
    conns = [RawConnection(host, int(port)) for _ in range(connections)]
    for c in conns:  # warm-up: connections and code paths
        await c.request("POST", "/v1/streams", body(str(uuid.uuid4())))

    def sender(c: RawConnection) -> Any:
        async def send() -> tuple[bool, str]:
            status, data = await c.request("POST", "/v1/streams", body(str(uuid.uuid4())))
            return status == 201, f"{status} {data[:200]!r}"
        return send

    ctl.mark("start")
    c0, t0 = time.process_time(), time.monotonic()
    lat, errors, lag = await _open_loop(rate, duration_s, [sender(c) for c in conns])
    load_cores = (time.process_time() - c0) / (time.monotonic() - t0)
    for c in conns:
        await c.close()
    return {"latency_ms": summarize(lat), "errors": len(errors), "error_samples": errors[:5],
            "max_send_lag_ms": lag, "load_cores": load_cores}


async def load_redis(ctl: Control, redis_url: str, rate: float, duration_s: float) -> dict[str, Any]:
    redis = connect(redis_url, max_connections=8)
    store = StreamStore(redis)

    async def send() -> tuple[bool, str]:
        sid, req = parse_create_body(body(str(uuid.uuid4())), RequestLimits())
        assert sid is not None
        try:
            res = await store.create(sid, req, model="default", max_queue=0, retention_s=3600)
        except RsbError as e:
            return False, e.code
        return res.created, "created" if res.created else "exists"

    lat, errors, lag = await _open_loop(rate, duration_s, [send] * 32)
    await redis.aclose()
    return {"latency_ms": summarize(lat), "errors": len(errors), "max_send_lag_ms": lag}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"rate": args.rate, "duration_s": args.duration_s,
                                      "connections": args.connections}}
    with procs.redis_server() as server, procs.procs() as started:
        # No generator runs: creates name no model, so they go to --default-model (else 503 starting).
        consumer, base = procs.start_consumer(server.url, "--max-queue", "0", "--default-model", "default")
        started.append(consumer)
        out["rsb"] = procs.run_load_measuring_cpu(
            "bench.scenarios.create:load_http",
            {"base": base, "rate": args.rate, "duration_s": args.duration_s, "connections": args.connections},
            [consumer.pid], args.duration_s + 120)
        consumer.stop()
        out["reference"] = procs.run_load("bench.scenarios.create:load_redis",
                                          {"redis_url": server.url, "rate": args.rate, "duration_s": args.duration_s})
    rsb, ref = out["rsb"]["latency_ms"], out["reference"]["latency_ms"]
    print(table(f"\n== create: {args.rate:g}/s open-loop for {args.duration_s:g} s (ms from scheduled send)",
                ["path", "requests", "p50", "p99", "max", "errors"],
                [["rsb POST /v1/streams", rsb["n"], rsb["p50"], rsb["p99"], rsb["max"], out["rsb"]["errors"]],
                 ["reference: CREATE script via redis-py", ref["n"], ref["p50"], ref["p99"], ref["max"],
                  out["reference"]["errors"]]]))
    print(f"consumer {out['rsb']['consumer_cores']:.2f} cores, load process {out['rsb']['load_cores']:.2f} cores;"
          f" load send lag max {out['rsb']['max_send_lag_ms']:.1f} ms")
    out["p99_ratio_to_reference"] = ratio(rsb["p99"], ref["p99"])
    out["goals"] = {"p99_le_20ms": rsb["p99"] <= 20, "zero_errors": out["rsb"]["errors"] == 0}
    print_goals("create", [goal_row("p99 (ms)", rsb["p99"], "<= 20 ms", rsb["p99"] <= 20),
                           goal_row("errors", out["rsb"]["errors"], "0", out["rsb"]["errors"] == 0)])
    return out
