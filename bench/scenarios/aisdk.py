"""aisdk: resume latency through the Vercel AI SDK view (GET /api/chat/{chat}/stream) vs the native route.

One running turn of ``--events`` events (queued, started, deltas; no terminal event: a resume only serves an
active turn) is written through the StreamStore and JobStore as a chat's running turn (its conversation's pending
turn). Each try opens a new TCP connection and reads until the last delta written so far, timed from sending the
request:

- view: ``GET /api/chat/bench/stream``, what ``useChat({resume: true})`` sends on page load. It always
  replays the turn from its start (the SDK cannot resume mid-turn), as UI message stream chunks;
- native from the start: ``GET /v1/streams/{id}/events``, the same events as rsb's own frames;
- native from the middle: the same with ``Last-Event-ID`` at the middle event (what a native client that
  kept its last id resumes with: half the events).

The three are interleaved try by try, so machine noise falls on all of them alike. Every try checks what
it read: the view's text is the stream's text and its message id the stream id; native ids all, in order.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import httpx
import orjson

from bench import procs
from bench.loadproc import Control
from bench.prefill import delta_text, prefill
from bench.report import table
from bench.scenarios.resume import resume_once
from bench.sseclient import client, parse_frame
from bench.stats import ratio, summarize
from broker.sse import ByteDecoder

CHAT_ID = "bench"
WARMUP = 5


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=2048, help="events in the running turn (default 2048)")
    p.add_argument("--tries", type=int, default=100, help="resumes measured per route (default 100)")


async def view_once(http: httpx.AsyncClient, base: str, stream_id: str, n_deltas: int,
                    expected_text: str) -> tuple[float, float, bool]:
    """(ms to the first chunk, ms to the last delta, what was read is right) of one resume through the view.
    Timed on the raw bytes like resume_once (the deltas are counted with a C-level bytes.count, and parsed
    after the clock stopped)."""
    t0 = time.time()
    first = last = float("nan")
    chunks: list[bytes] = []
    seen = 0
    marker = b'"type":"text-delta"'
    tail = b""
    async with http.stream("GET", f"{base}/api/chat/{CHAT_ID}/stream") as r:
        async for chunk in r.aiter_raw():
            if math.isnan(first) and b"data:" in chunk:
                first = (time.time() - t0) * 1000
            chunks.append(chunk)
            # The previous chunk's last bytes count a marker split across the two (once: they are too short
            # to hold a whole one).
            seen += (tail + chunk).count(marker)
            tail = chunk[-(len(marker) - 1):]
            if seen >= n_deltas:
                last = (time.time() - t0) * 1000
                break
    texts: list[str] = []
    message_id = None
    decoder = ByteDecoder()
    for block in (b for c in chunks for b in decoder.feed(c) if b):
        f = parse_frame(block, 0.0)
        if not f.data:
            continue  # a heartbeat comment
        item = orjson.loads(f.data)
        if item["type"] == "start":
            message_id = item["messageId"]
        elif item["type"] == "text-delta":
            texts.append(item["delta"])
    return first, last, message_id == stream_id and "".join(texts[:n_deltas]) == expected_text

async def load_aisdk(ctl: Control, base: str, sid: str, event_ids: list[str], tries: int) -> dict[str, Any]:
    n_deltas = len(event_ids) - 2
    expected_text = "".join(delta_text(i) for i in range(n_deltas))
    mid = len(event_ids) // 2
    runs = {
        "view": lambda http: view_once(http, base, sid, n_deltas, expected_text),
        "native_start": lambda http: resume_once(http, base, sid, "0-0", event_ids),
        "native_middle": lambda http: resume_once(http, base, sid, event_ids[mid - 1], event_ids[mid:]),
    }
    firsts: dict[str, list[float]] = {k: [] for k in runs}
    lasts: dict[str, list[float]] = {k: [] for k in runs}
    bad = dict.fromkeys(runs, 0)
    async with client(keepalive=False) as http:
        for i in range(WARMUP + tries):
            for name, run in runs.items():
                first, last, ok = await run(http)
                if i >= WARMUP:
                    firsts[name].append(first)
                    lasts[name].append(last)
                    bad[name] += 0 if ok else 1
    return {name: {"first_chunk_ms": summarize(firsts[name]), "last_event_ms": summarize(lasts[name]),
                   "incorrect": bad[name]} for name in runs} | {"events": len(event_ids)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"events": args.events, "tries": args.tries}}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        (stream,) = prefill(server.url, 1, args.events, finish=False, conversation=CHAT_ID)
        res = procs.run_load("bench.scenarios.aisdk:load_aisdk",
                             {"base": base, "sid": stream["id"], "event_ids": stream["event_ids"],
                              "tries": args.tries})
    out["rsb"] = res
    names = {"view": "AI SDK view, from the start", "native_start": "native, from the start",
             "native_middle": "native, from the middle (Last-Event-ID)"}
    print(table(f"\n== resume of a running {res['events']}-event turn: ms to its last event",
                ["route", "p50", "p99", "max", "incorrect"],
                [[names[k], res[k]["last_event_ms"]["p50"],
                  res[k]["last_event_ms"]["p99"], res[k]["last_event_ms"]["max"], res[k]["incorrect"]]
                 for k in names]))
    out["view_to_native_start_p50"] = ratio(res["view"]["last_event_ms"]["p50"],
                                            res["native_start"]["last_event_ms"]["p50"])
    out["view_to_native_middle_p50"] = ratio(res["view"]["last_event_ms"]["p50"],
                                             res["native_middle"]["last_event_ms"]["p50"])
    print(f"view / native from the start, p50: {out['view_to_native_start_p50']:.2f}x; "
          f"view / native from the middle: {out['view_to_native_middle_p50']:.2f}x")
    return out
