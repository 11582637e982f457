"""durable: append -> live reader latency through the Durable Streams view, next to the native view.

Native view (the reference, same run): ``--streams`` generations of the paced engine at ``--rate`` tokens/s
each, read over ``/v1/streams/{id}/events`` (bench.scenarios.latency's load). Durable Streams: ``--streams``
JSON streams; a writer process appends ``{"t": <unix time>}`` to each at ``--rate`` per second, its POSTs going
to a second consumer (another pod: appends and reads meet only in Redis, as across a deployment);
readers follow every stream on the first consumer, with ``live=sse``, then with ``live=long-poll``; each mode
runs twice, with the appends made by the append script directly (what a POST runs: only the reading pod's
work differs from the native view's) and then over HTTP (the whole path a producer takes). Two
measures for each path: from the moment Redis stored the append (the millisecond of the entry id: the
native event id, the first half of a Durable Streams offset) to receipt, and from the producer's own
timestamp to receipt (native: the paced engine's token time; Durable Streams: just before the POST).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx
import orjson

from bench import procs
from bench.loadproc import Control
from bench.report import table
from bench.sseclient import RawConnection, client, frames
from bench.stats import ratio, summarize

MODES = ("sse", "long-poll")
VIAS = ("redis", "http")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=50, help="live streams (default 50)")
    p.add_argument("--rate", type=float, default=10.0, help="appends (tokens) per second per stream (default 10)")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--duration-s", type=float, default=15.0, help="measured window per path (default 15)")


def _offset_ms(offset: str) -> int:
    return int(offset.split("_", 1)[0])


async def load_ds(ctl: Control, base: str, paths: list[str], mode: str, warmup_s: float,
                  duration_s: float) -> dict[str, Any]:
    """Readers following every stream from its tail (``offset=now``), live, in ``mode``."""
    lat: list[float] = []
    lat_id: list[float] = []
    window = [float("inf"), float("inf")]
    connected = 0
    errors: list[str] = []
    all_connected = asyncio.Event()

    def record(items: list[dict[str, float]], offset: str, t: float) -> None:
        if window[0] <= t <= window[1]:
            lat.extend((t - item["t"]) * 1000 for item in items)
            lat_id.append(t * 1000 - _offset_ms(offset))

    def joined() -> None:
        nonlocal connected
        connected += 1
        if connected == len(paths):
            all_connected.set()

    async with client() as http:

        async def sse(path: str) -> None:
            async with http.stream("GET", f"{base}{path}", params={"offset": "now", "live": "sse"}) as r:
                joined()
                items: list[dict[str, float]] = []
                async for f in frames(r):
                    if f.event == b"data":
                        items = orjson.loads(f.data)
                    elif f.event == b"control":
                        if items:
                            record(items, orjson.loads(f.data)["streamNextOffset"], f.t)
                        items = []
                    if f.t > window[1]:
                        return

        async def long_poll(path: str) -> None:
            offset = "now"
            first = True
            while time.time() <= window[1]:
                r = await http.get(f"{base}{path}", params={"offset": offset, "live": "long-poll"})
                t = time.time()
                if first:
                    joined()
                    first = False
                if r.status_code == 200:
                    record(r.json(), r.headers["stream-next-offset"], t)
                elif r.status_code != 204:
                    raise RuntimeError(f"long-poll answered {r.status_code}")
                offset = r.headers["stream-next-offset"]

        async def reader(path: str) -> None:
            try:
                await (sse(path) if mode == "sse" else long_poll(path))
            except (httpx.HTTPError, RuntimeError) as e:
                errors.append(repr(e))

        tasks = [asyncio.create_task(reader(p)) for p in paths]
        try:
            await asyncio.wait_for(all_connected.wait(), 120)
        except TimeoutError:
            pass
        window[0] = time.time() + warmup_s
        window[1] = window[0] + duration_s
        ctl.mark("connected", readers=connected)
        c0 = time.process_time()
        await asyncio.sleep(warmup_s + duration_s + 1.0)
        load_cores = (time.process_time() - c0) / (warmup_s + duration_s + 1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"latency_ms": summarize(lat), "latency_from_xadd_ms": summarize(lat_id), "readers_connected": connected,
            "n_errors": len(errors), "errors": errors[:5], "load_cores": load_cores,
            "appends_per_s": len(lat) / duration_s}


async def ds_writer(ctl: Control, redis_url: str, base: str, paths: list[str], rate: float, seconds: float,
                    via: str, connections: int = 16) -> dict[str, Any]:
    """``{"t": now}`` to every stream ``rate`` times a second, spread over each period like independent
    producers. ``via`` ``http``: POSTs to a consumer, over raw HTTP/1.1 keep-alive connections (httpx's own
    CPU would be the bottleneck at this rate); ``redis``: the append script itself (what the POST runs), so the
    reading pod's work is all that differs from the native view's."""
    import redis.asyncio as aioredis

    from broker.durable.store import DurableStore

    store = DurableStore(aioredis.Redis.from_url(redis_url, max_connections=connections))
    host, port = base.removeprefix("http://").split(":")
    conns = [RawConnection(host, int(port)) for _ in range(connections)]
    period = 1.0 / rate
    groups = [paths[i::10] for i in range(10)]
    outcomes: dict[str, int] = {}

    async def send(conn: RawConnection, batch: list[str]) -> None:
        for path in batch:
            body = orjson.dumps({"t": time.time()})
            if via == "http":
                status, _ = await conn.request("POST", path, body)
                key = str(status)
            else:
                key = (await store.append(store.keys("", path.removeprefix("/v1/stream/")), body,
                                          "application/json")).outcome.value
            outcomes[key] = outcomes.get(key, 0) + 1

    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        for gi, group in enumerate(groups):
            delay = t0 + n * period + gi * period / len(groups) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await asyncio.gather(*(send(conn, group[i::connections]) for i, conn in enumerate(conns)))
        n += 1
    for conn in conns:
        await conn.close()
    await store.redis.aclose()
    return {"outcomes": outcomes}


def _ds_run(args: argparse.Namespace, mode: str, via: str) -> dict[str, Any]:
    with procs.redis_server() as server, procs.procs() as started:
        reader_pod, base = procs.start_consumer(server.url, "--ds-long-poll-timeout-s", "20")
        writer_pod, writer_base = procs.start_consumer(server.url)
        started += [reader_pod, writer_pod]
        paths = [f"/v1/stream/bench-{i}" for i in range(args.streams)]
        with httpx.Client(timeout=30) as c:
            for path in paths:
                c.put(f"{writer_base}{path}", headers={"content-type": "application/json"}).raise_for_status()
        load = procs.Load("bench.scenarios.durable:load_ds",
                          {"base": base, "paths": paths, "mode": mode, "warmup_s": args.warmup_s,
                           "duration_s": args.duration_s}, name=f"ds-{mode}")
        try:
            connected = load.wait_mark("connected", 180)["readers"]
            writer = procs.Load("bench.scenarios.durable:ds_writer",
                                {"redis_url": server.url, "base": writer_base, "paths": paths, "rate": args.rate,
                                 "seconds": args.warmup_s + args.duration_s + 1.0, "via": via}, name="ds-writer")
            try:
                result: dict[str, Any] = load.finish(args.warmup_s + args.duration_s + 120)
                result["writer"] = writer.finish(60)
            finally:
                writer.kill()
        finally:
            load.kill()
        result["readers_connected"] = connected
        return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"streams": args.streams, "rate": args.rate, "warmup_s": args.warmup_s,
                                      "duration_s": args.duration_s},
                           "engine": "paced (deterministic, bench/paced_engine.py) for the native view"}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        started.append(procs.start_paced_generator(server.url, workers=args.streams, tokens_per_s=args.rate,
                                                   extra=("--pool", "64")))
        load = procs.Load("bench.scenarios.latency:load_rsb",
                          {"base": base, "streams": args.streams, "rate": args.rate, "warmup_s": args.warmup_s,
                           "duration_s": args.duration_s})
        try:
            load.wait_mark("connected", 300)
            out["native"] = load.finish(args.warmup_s + args.duration_s + 180)
        finally:
            load.kill()
    paths = [("native SSE", "native")]
    for mode in MODES:
        for via in VIAS:
            key = f"ds_{mode}_{via}"
            out[key] = _ds_run(args, mode, via)
            paths.append((f"Durable Streams live={mode}, appends via {via}", key))

    rows = []
    for label, key in paths:
        r = out[key]
        xadd, stamp = r["latency_from_xadd_ms"], r["latency_ms"]
        rows.append([label, stamp["n"], xadd["p50"], xadd["p99"], stamp["p50"], stamp["p99"], r["n_errors"]])
    print(table(f"\n== durable: {args.streams} streams x {args.rate:g} appends/s, append -> live reader (ms)",
                ["path", "messages", "append p50", "append p99", "producer p50", "producer p99", "errors"], rows))
    native_p99 = out["native"]["latency_from_xadd_ms"]["p99"]
    out["p99_ratio_to_native"] = {key: ratio(out[key]["latency_from_xadd_ms"]["p99"], native_p99)
                                  for _, key in paths[1:]}
    print("append -> reader p99 relative to the native view: "
          + ", ".join(f"{key} {r:.2f}x" for key, r in out["p99_ratio_to_native"].items()))
    return out
