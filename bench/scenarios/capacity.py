"""capacity: many concurrent idle SSE readers on one consumer process, heartbeats on.

The load process creates ``--streams`` streams (no generator runs, so they stay queued and their readers
idle), then opens ``--readers`` SSE readers over them (each gets its ``queued`` event, then only
heartbeats). Measured on the consumer: RSS per reader ((RSS with readers - RSS before) / readers), its
Redis connections (CLIENT LIST entries whose address is one of the consumer's sockets), and its CPU
while idle with every reader connected (cores = CPU seconds / wall second over ``--idle-s``).
Reference, same run and load: a bare Starlette/uvicorn app holding the same number of SSE responses
that only send heartbeats (bench/direct_app.py ``/idle``), i.e. what the connections alone cost.

The consumer runs with its default connection limits (1,000 open streams per client address, 1,200
connections per address, 90% of the open-file limit per pod, the head timeout): the readers come from
``ceil(readers / 1000)`` loopback addresses (127.0.0.2, 127.0.0.3, ...), as many users behind as many
addresses would. Only the setup's creates (all from one address, never finished) run with the per-caller
create limits lifted.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import httpx
import orjson
import redis

from bench import procs
from bench.loadproc import Control
from bench.report import goal_row, print_goals, table
from bench.sampling import CpuWindow, redis_clients_of, rss_bytes
from bench.sseclient import RawConnection
from bench.stats import ratio

CLIENTS_SHARD = 100  # readers per httpx client: a small pool per client keeps httpx's pool scans short
READERS_PER_ADDRESS = 1000  # the consumer's default --max-streams-per-ip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--readers", type=int, default=10000, help="concurrent SSE readers (default 10000)")
    p.add_argument("--streams", type=int, default=0, help="streams they read (default: one per reader)")
    p.add_argument("--heartbeat-s", type=float, default=15.0, help="consumer --heartbeat-s (default 15)")
    p.add_argument("--idle-s", type=float, default=30.0, help="idle window measured for CPU (default 30)")


async def _create_streams(base: str, n: int) -> list[str]:
    host, port = base.removeprefix("http://").split(":")
    sids = [str(uuid.uuid4()) for _ in range(n)]
    conns = [RawConnection(host, int(port)) for _ in range(32)]

    async def work(c: RawConnection, part: list[str]) -> None:
        for sid in part:
            status, data = await c.request("POST", "/v1/streams", orjson.dumps({"id": sid, "prompt": "idle"}))
            if status != 201:
                raise RuntimeError(f"create: {status} {data[:200]!r}")
        await c.close()

    await asyncio.gather(*(work(c, sids[i::32]) for i, c in enumerate(conns)))
    return sids


async def load_readers(ctl: Control, base: str, readers: int, streams: int, path: str) -> dict[str, Any]:
    """Open ``readers`` SSE responses (``path`` None: rsb streams, else that path), hold them until told."""
    sids = await _create_streams(base, streams) if path == "" else []
    ctl.mark("created")
    await ctl.wait_go()
    def address(shard: int) -> str:
        return f"127.0.0.{2 + shard * CLIENTS_SHARD // READERS_PER_ADDRESS}"

    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address(i),
                                                                    limits=httpx.Limits(max_connections=None)),
                                 timeout=httpx.Timeout(3600, connect=60))
               for i in range(-(-readers // CLIENTS_SHARD))]
    first = asyncio.Semaphore(200)  # connects in flight
    got_first = 0
    all_in = asyncio.Event()
    beats = [0] * readers
    failed: list[str] = []

    async def reader(i: int) -> None:
        nonlocal got_first
        http = clients[i // CLIENTS_SHARD]
        url = f"{base}{path}" if path else f"{base}/v1/streams/{sids[i % len(sids)]}/events"
        try:
            await first.acquire()
            released = False
            async with http.stream("GET", url) as r:
                async for chunk in r.aiter_raw():
                    if not released:
                        released = True
                        first.release()
                        got_first += 1
                        if got_first + len(failed) >= readers:
                            all_in.set()
                    beats[i] += chunk.count(b": keep-alive")
        except (httpx.HTTPError, OSError) as e:
            failed.append(repr(e))
            if got_first + len(failed) >= readers:
                all_in.set()
            first.release()

    t0 = time.monotonic()
    tasks = [asyncio.create_task(reader(i)) for i in range(readers)]
    await all_in.wait()
    ctl.mark("connected", seconds=time.monotonic() - t0, failed=len(failed))
    await ctl.wait_go()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in clients:
        await c.aclose()
    return {"connected": got_first, "failed": len(failed), "failures": failed[:5],
            "heartbeats_per_reader": sum(beats) / max(1, readers)}


def _measure(server_pid: int, load: procs.Load, readers: int, idle_s: float,
             redis_url: str | None) -> dict[str, Any]:
    load.wait_mark("created", 600)
    time.sleep(2.0)
    rss0 = rss_bytes(server_pid)
    load.go()
    conn = load.wait_mark("connected", 900)
    time.sleep(3.0)
    rss1 = rss_bytes(server_pid)
    res: dict[str, Any] = {"connect_s": conn["seconds"], "rss_before_mib": rss0 / 2**20,
                           "rss_with_readers_mib": rss1 / 2**20,
                           "rss_per_reader_kib": (rss1 - rss0) / max(1, readers - conn["failed"]) / 1024}
    if redis_url:
        client = redis.Redis.from_url(redis_url)
        res["redis_connections"] = redis_clients_of(client, server_pid)
        res["redis_connections_total"] = len(client.client_list())
        client.close()
    cpu = CpuWindow([server_pid]).start()
    time.sleep(idle_s)
    cpu.stop()
    res["idle_cores"] = cpu.cores
    load.go()
    res.update(load.finish(300))
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    streams = args.streams or args.readers
    out: dict[str, Any] = {"params": {"readers": args.readers, "streams": streams, "heartbeat_s": args.heartbeat_s,
                                      "idle_s": args.idle_s}}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url, "--heartbeat-s", str(args.heartbeat_s),
                                              lifted=procs.UNLIMITED_CREATES)
        started.append(consumer)
        load = procs.Load("bench.scenarios.capacity:load_readers",
                          {"base": base, "readers": args.readers, "streams": streams, "path": ""})
        try:
            out["rsb"] = _measure(consumer.pid, load, args.readers, args.idle_s, server.url)
        finally:
            load.kill()
        consumer.stop()
        direct, dbase = procs.start_direct(20.0, "--heartbeat-s", str(args.heartbeat_s))
        started.append(direct)
        load = procs.Load("bench.scenarios.capacity:load_readers",
                          {"base": dbase, "readers": args.readers, "streams": 0, "path": "/idle"})
        try:
            out["reference"] = _measure(direct.pid, load, args.readers, args.idle_s, None)
        finally:
            load.kill()
    rsb, ref = out["rsb"], out["reference"]
    print(table(f"\n== capacity: {args.readers} idle SSE readers, heartbeat every {args.heartbeat_s:g} s",
                ["server", "connected", "KiB/reader", "RSS MiB", "idle cores", "heartbeats/reader", "connect s"],
                [["rsb consumer", rsb["connected"], rsb["rss_per_reader_kib"], rsb["rss_with_readers_mib"],
                  rsb["idle_cores"], rsb["heartbeats_per_reader"], rsb["connect_s"]],
                 ["reference: bare uvicorn SSE", ref["connected"], ref["rss_per_reader_kib"],
                  ref["rss_with_readers_mib"], ref["idle_cores"], ref["heartbeats_per_reader"], ref["connect_s"]]]))
    print(f"consumer Redis connections: {rsb['redis_connections']} (all clients of Redis: "
          f"{rsb['redis_connections_total']})")
    out["rss_ratio_to_reference"] = ratio(rsb["rss_per_reader_kib"], ref["rss_per_reader_kib"])
    out["cpu_ratio_to_reference"] = ratio(rsb["idle_cores"], ref["idle_cores"])
    kib, cpu_ratio = rsb["rss_per_reader_kib"], out["cpu_ratio_to_reference"]
    out["goals"] = {"rss_le_16kib": kib <= 16, "redis_conns_le_8": rsb["redis_connections"] <= 8,
                    "idle_cpu_le_1_2x_reference": cpu_ratio <= 1.2,
                    "all_connected": rsb["connected"] == args.readers}
    print_goals("capacity", [
        goal_row("RSS per reader (KiB)", kib, "<= 16 KiB", kib <= 16),
        goal_row("consumer Redis connections", rsb["redis_connections"], "<= 8", rsb["redis_connections"] <= 8),
        goal_row("idle CPU / bare uvicorn's", cpu_ratio, "<= 1.2x", cpu_ratio <= 1.2, "x"),
        goal_row("readers connected", rsb["connected"], f"{args.readers}", rsb["connected"] == args.readers),
    ])
    return out
