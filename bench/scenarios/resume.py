"""resume: reconnect at the middle of a 4,096-event stream; time until the last replayed event.

Each try opens a new TCP connection to the consumer with ``Last-Event-ID`` = the 2,048th event's id and
reads the remaining 2,048 events (the last is ``done``); the time runs from sending the request to
receiving that last event. Every try checks the ids: all events after the resume point, in order, once.
Reference, same run and load process: redis-py XRANGE of the same 2,048 entries (pages of 512, like the
consumer), i.e. what reading them costs without HTTP/SSE.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench import procs
from bench.loadproc import Control
from bench.prefill import prefill
from bench.report import goal_row, print_goals, table
from bench.sseclient import client, parse_frame
from bench.stats import ratio, summarize
from broker.sse import ByteDecoder
from broker.streams.keys import StreamKeys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=4096, help="events in the stream (default 4096)")
    p.add_argument("--tries", type=int, default=200, help="reconnects measured (default 200)")


async def resume_once(http: httpx.AsyncClient, base: str, sid: str, after: str,
                      expected: list[str]) -> tuple[float, float, bool]:
    """(ms to first event, ms to last event, ids correct) of one resume.

    Timed on the raw bytes, as the peer's reader is (bench peer): the clock stops when the chunk holding
    the last expected id arrives, and the frames are parsed after it stopped, so the client's own Python
    parsing is not counted on rsb's side only."""
    t0 = time.time()
    chunks: list[bytes] = []
    first = last = float("nan")
    last_id = b"id: " + expected[-1].encode() + b"\n"
    tail = b""
    async with http.stream("GET", f"{base}/v1/streams/{sid}/events", headers={"Last-Event-ID": after}) as r:
        async for chunk in r.aiter_raw():
            if not chunks and b"\nid: " not in b"\n" + chunk:
                continue  # a heartbeat before any event
            if not chunks:
                first = (time.time() - t0) * 1000
            chunks.append(chunk)
            # The id line may straddle two chunks: look at the end of the previous one too.
            if last_id in tail[-len(last_id):] + chunk:
                last = (time.time() - t0) * 1000
                break
            tail = chunk
    decoder = ByteDecoder()
    got = [f.id.decode() if f.id else "" for c in chunks for b in decoder.feed(c) if b
           for f in [parse_frame(b, 0.0)] if f.event is not None]
    return first, last, got == expected

async def load_resume(ctl: Control, base: str, redis_url: str, sid: str, event_ids: list[str],
                      tries: int) -> dict[str, Any]:
    mid = len(event_ids) // 2
    after, expected = event_ids[mid - 1], event_ids[mid:]
    firsts, lasts, refs = [], [], []
    bad = 0
    async with client(keepalive=False) as http:
        for _ in range(5):  # warm the consumer's code paths and pools
            await resume_once(http, base, sid, after, expected)
        for _ in range(tries):
            f, last, ok = await resume_once(http, base, sid, after, expected)
            firsts.append(f)
            lasts.append(last)
            bad += 0 if ok else 1
    keys = StreamKeys.of(__import__("uuid").UUID(sid), 1)
    r = aioredis.Redis.from_url(redis_url)
    for i in range(tries + 5):
        t0 = time.time()
        start, n = f"({after}", 0
        while True:
            page = await r.xrange(keys.events, min=start, max="+", count=512)
            n += len(page)
            if len(page) < 512:
                break
            start = "(" + page[-1][0].decode()
        if i >= 5:
            refs.append((time.time() - t0) * 1000)
        assert n == len(expected), n
    await r.aclose()
    return {"first_event_ms": summarize(firsts), "last_event_ms": summarize(lasts), "incorrect": bad,
            "reference_xrange_ms": summarize(refs), "replayed_events": len(expected)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"events": args.events, "tries": args.tries}}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        (stream,) = prefill(server.url, 1, args.events)
        res = procs.run_load("bench.scenarios.resume:load_resume",
                             {"base": base, "redis_url": server.url, "sid": stream["id"],
                              "event_ids": stream["event_ids"], "tries": args.tries})
    out["rsb"] = res
    first, last, ref = res["first_event_ms"], res["last_event_ms"], res["reference_xrange_ms"]
    print(table(f"\n== resume at the middle of a {args.events}-event stream ({res['replayed_events']} replayed), ms",
                ["measure", "p50", "p99", "max"],
                [["rsb: first replayed event", first["p50"], first["p99"], first["max"]],
                 ["rsb: last replayed event", last["p50"], last["p99"], last["max"]],
                 ["reference: XRANGE of the same entries", ref["p50"], ref["p99"], ref["max"]]]))
    print(f"incorrect replays: {res['incorrect']} of {args.tries}")
    out["p50_ratio_to_reference"] = ratio(last["p50"], ref["p50"])
    out["goals"] = {"p50_le_25ms": last["p50"] <= 25, "p99_le_50ms": last["p99"] <= 50,
                    "all_correct": res["incorrect"] == 0}
    print_goals("resume", [goal_row("last replayed event p50 (ms)", last["p50"], "<= 25 ms", last["p50"] <= 25),
                           goal_row("last replayed event p99 (ms)", last["p99"], "<= 50 ms", last["p99"] <= 50),
                           goal_row("incorrect replays", res["incorrect"], "0", res["incorrect"] == 0),
                           ["p50 / reference p50", f"{out['p50_ratio_to_reference']:.1f}x", "(info)", "-"]])
    return out
