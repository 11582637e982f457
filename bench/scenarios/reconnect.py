"""reconnect: a pod drained under 2,000 live readers; every reader reconnects through nginx to the other pod.

rsb: ``--streams`` live generations of the paced engine at ``--rate`` tokens/s, each read by ``--readers /
--streams`` SSE readers (a lean client, ``bench.sseclient.SSEStream``, from ``--addresses`` loopback
addresses, as users behind that many addresses) through a real nginx running deploy/nginx.conf
(``bench.procs.Nginx``) in front of two consumer pods. Every reader attaches while only pod A is up (nginx
skips B, whose port refuses); then pod B starts and pod A gets SIGTERM: it drains, sending each reader
``retry: 1000`` and ending the body at an event boundary. Each reader does what EventSource does: waits the
hinted ``retry`` and reconnects with ``Last-Event-ID``; nginx sends it to pod B. Measured: for every reader,
the time from the drain (SIGTERM) to the first event on its new connection (p50 / p99 / max), and that
nothing was lost or repeated: in the end all streams are cancelled, every reader reads to the terminal event,
and its ids and events are compared with the stream's entries in Redis (XRANGE), one by one.

Reference: none runs next to it; the goal is absolute (p99 <= 5 s, 0 lost, 0 repeated). The retry hint (1 s)
is part of every reader's time.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from bench import procs
from bench.loadproc import Control
from bench.report import goal_row, print_goals, table
from bench.sampling import CpuWindow
from bench.sseclient import Creator, SSEStream
from bench.stats import summarize
from broker.redis.server import free_port
from broker.streams.keys import StreamKeys

# Attaches in flight: each is a create (streams only) and a GET through nginx.
ATTACHING = 64


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--readers", type=int, default=2000, help="SSE readers (default 2000)")
    p.add_argument("--streams", type=int, default=1000, help="live streams they follow (default 1000)")
    p.add_argument("--rate", type=float, default=5.0, help="tokens/s per stream (default 5)")
    p.add_argument("--addresses", type=int, default=4,
                   help="loopback addresses the readers come from (default 4: 500 each, within nginx's per-address "
                        "limits in deploy/nginx.conf)")
    p.add_argument("--hold-s", type=float, default=5.0, help="time on pod B before the streams are cancelled")
    p.add_argument("--gen-procs", type=int, default=2, help="paced-generator processes (default 2)")


class Reader:
    """One reader: what it received (ids, events), its connections, when its first event after the drain came."""

    __slots__ = ("address", "connections", "done", "drain_at", "errors", "events", "first_after_drain", "ids",
                 "new_stream", "sid", "statuses", "stream")

    def __init__(self, sid: str, address: str, drain_at: list[float]) -> None:
        self.sid = sid
        self.address = address
        self.drain_at = drain_at
        self.ids: list[bytes] = []
        self.events: list[tuple[bytes | None, bytes]] = []
        self.connections = 0
        self.first_after_drain: float | None = None
        self.done = False
        self.errors: list[str] = []
        self.statuses: list[int] = []
        self.stream: SSEStream | None = None
        self.new_stream: SSEStream | None = None  # the first connection opened after the drain

    def on_frames(self, stream: SSEStream, frames: list[tuple[bytes | None, bytes | None, bytes]], t: float) -> None:
        for eid, event, data in frames:
            if eid is None:
                continue
            self.ids.append(eid)
            self.events.append((event, data))
            if event in (b"done", b"cancelled", b"error"):
                self.done = True
        if self.first_after_drain is None and stream is self.new_stream:
            self.first_after_drain = t - self.drain_at[0]


async def follow(r: Reader, host: str, port: int, attach: asyncio.Semaphore, attached: list[int],
                 all_attached: asyncio.Event, total: int) -> None:
    """Read to the terminal event, reconnecting as EventSource does (after the hinted ``retry``, with
    ``Last-Event-ID``), at most 20 connections."""
    retry_s = 1.0
    while not r.done and r.connections < 20:
        headers = [("last-event-id", r.ids[-1].decode())] if r.ids else []
        r.connections += 1
        after_drain = time.time() >= r.drain_at[0]
        try:
            if r.connections == 1:
                async with attach:
                    stream = await SSEStream.open(host, port, f"/v1/streams/{r.sid}/events", r.on_frames, headers,
                                                  r.address)
                    status = await stream.status
            else:
                stream = await SSEStream.open(host, port, f"/v1/streams/{r.sid}/events", r.on_frames, headers,
                                              r.address)
                status = await stream.status
        except OSError as e:
            r.errors.append(repr(e))
            await asyncio.sleep(retry_s)
            continue
        r.stream = stream
        if after_drain and r.new_stream is None and status == 200:
            r.new_stream = stream  # (events may have come in already: the head and the first page in one read)
            if r.first_after_drain is None and stream.received:
                r.first_after_drain = stream.received - r.drain_at[0]
        r.statuses.append(status)
        if r.connections == 1:
            attached[0] += 1
            if attached[0] == total:
                all_attached.set()
        if status == 204:  # resumed at the terminal event
            r.done = True
            return
        if status != 200:
            r.errors.append(f"GET events: {status} {stream.body[:120]!r}")
            await asyncio.sleep(retry_s)
            continue
        await stream.ended
        if stream.retry_ms is not None:
            retry_s = stream.retry_ms / 1000
        if not r.done:
            await asyncio.sleep(retry_s)


async def load_reconnect(ctl: Control, base: str, direct: str, redis_url: str, readers: int, streams: int,
                         rate: float, addresses: int, hold_s: float) -> dict[str, Any]:
    host, port = base.removeprefix("http://").split(":")
    dhost, dport = direct.removeprefix("http://").split(":")
    creator = Creator(dhost, int(dport))
    # Long enough never to end on its own: the scenario cancels every stream at its end.
    sids = await asyncio.gather(*(creator.create(max_tokens=32768) for _ in range(streams)))
    drain_at = [float("inf")]
    rs = [Reader(sids[i % streams], f"127.0.0.{2 + i % addresses}", drain_at) for i in range(readers)]
    attach = asyncio.Semaphore(ATTACHING)
    attached = [0]
    all_attached = asyncio.Event()
    t0, cpu0 = time.monotonic(), time.process_time()
    tasks = [asyncio.create_task(follow(r, host, int(port), attach, attached, all_attached, readers)) for r in rs]
    try:
        await asyncio.wait_for(all_attached.wait(), 300)
    except TimeoutError:
        pass
    attach_s = time.monotonic() - t0
    ctl.mark("attached", readers=attached[0], seconds=attach_s)
    await ctl.wait_go()  # pod B is up; pod A gets SIGTERM right after this
    drain_at[0] = time.time()
    c0 = time.process_time()
    deadline = time.monotonic() + 120
    # Polled (5 times a second, O(readers)): an event per reader set from the frame callbacks would cost the
    # hot path more than this loop does.
    while time.monotonic() < deadline and any(r.first_after_drain is None and not r.done for r in rs):  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    reconnect_cpu_s = time.process_time() - c0
    ctl.mark("reconnected")
    await asyncio.sleep(hold_s)
    # The end: every stream cancelled (through pod B), every reader reads to its terminal event.
    cancel_from = Creator(host, int(port), connections=4)
    await asyncio.gather(*(cancel_from.post(f"/v1/streams/{sid}/cancel") for sid in sids), return_exceptions=True)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    except TimeoutError:
        for t in tasks:
            t.cancel()
    read_cpu_s = time.process_time() - cpu0
    for r in rs:
        if r.stream is not None:
            r.stream.close()
    await creator.aclose()
    await cancel_from.aclose()
    # What Redis has, stream by stream, against what each reader received.
    red = aioredis.Redis.from_url(redis_url)
    truth: dict[str, tuple[list[bytes], list[tuple[bytes, bytes]]]] = {}
    for sid in sids:
        entries: Any = await red.xrange(StreamKeys.of(uuid.UUID(sid), 1).events)
        truth[sid] = ([e[0] for e in entries], [(e[1][b"t"], e[1][b"d"]) for e in entries])
    await red.aclose()
    lost = repeated = wrong = unfinished = 0
    for r in rs:
        ids, events = truth[r.sid]
        got = set(r.ids)
        repeated += len(r.ids) - len(got)
        lost += sum(1 for i in ids if i not in got)
        if not r.done:
            unfinished += 1
        if r.ids == ids and r.events != events:
            wrong += 1  # the right ids with other contents
    times = [r.first_after_drain for r in rs if r.first_after_drain is not None]
    never = sum(1 for r in rs if r.first_after_drain is None and not r.done)
    errors = [e for r in rs for e in r.errors]
    events_after = sum(len(r.ids) for r in rs)
    return {"attached": attached[0], "attach_s": attach_s, "next_event_s": summarize(times),
            "never_reconnected": never, "lost": lost, "repeated": repeated, "wrong_content": wrong,
            "unfinished": unfinished, "n_errors": len(errors), "errors": errors[:5],
            "connections": summarize([float(r.connections) for r in rs]),
            "statuses": sorted({s for r in rs for s in r.statuses}),
            "events_received": events_after, "load_cpu_s_reconnect": reconnect_cpu_s,
            "load_us_per_event": read_cpu_s / max(1, events_after) * 1e6}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"readers": args.readers, "streams": args.streams, "rate": args.rate,
                                      "addresses": args.addresses, "hold_s": args.hold_s},
                           "engine": "paced (deterministic, bench/paced_engine.py)"}
    with procs.redis_server() as server, procs.procs() as started:
        pod_a, base_a = procs.start_consumer(server.url, "--heartbeat-s", "15")
        started.append(pod_a)
        port_b = free_port()
        with procs.nginx([int(base_a.rsplit(":", 1)[1]), port_b]) as nginx:
            per = -(-args.streams // args.gen_procs)
            for _ in range(args.gen_procs):
                started.append(procs.start_paced_generator(server.url, workers=per, tokens_per_s=args.rate,
                                                           extra=("--pool", "64")))
            load = procs.Load("bench.scenarios.reconnect:load_reconnect",
                              {"base": nginx.url, "direct": base_a, "redis_url": server.url, "readers": args.readers,
                               "streams": args.streams, "rate": args.rate, "addresses": args.addresses,
                               "hold_s": args.hold_s})
            try:
                mark = load.wait_mark("attached", 400)
                out["attached"], out["attach_s"] = mark["readers"], mark["seconds"]
                pod_b, _ = procs.start_consumer(server.url, "--heartbeat-s", "15", port=port_b)
                started.append(pod_b)
                time.sleep(2.0)  # readers keep reading on A meanwhile
                cpu_b = CpuWindow([pod_b.pid]).start()
                cpu_load = CpuWindow([load.pid]).start()
                t_drain = time.monotonic()
                exited: list[float] = []

                def wait_exit() -> None:
                    pod_a.wait(120)
                    exited.append(time.monotonic() - t_drain)

                waiter = threading.Thread(target=wait_exit, daemon=True)
                load.go()
                pod_a.signal(signal.SIGTERM)
                waiter.start()
                load.wait_mark("reconnected", 200)
                cpu_b.stop()
                cpu_load.stop()
                waiter.join(120)
                out["pod_a_exit_s"] = exited[0] if exited else float("nan")
                out["rsb"] = load.finish(300)
            finally:
                load.kill()
            out["rsb"]["pod_b_cores_reconnect"] = cpu_b.cores
            out["rsb"]["load_cores_reconnect"] = cpu_load.cores
    rsb = out["rsb"]
    t = rsb["next_event_s"]
    print(table(f"\n== reconnect: {args.readers} readers of {args.streams} live streams ({args.rate:g} tokens/s) "
                "on pod A, SIGTERM, through nginx to pod B",
                ["measure", "n", "p50", "p99", "max"],
                [["drain -> next event on pod B (s)", t["n"], t["p50"], t["p99"], t["max"]],
                 ["connections per reader", rsb["connections"]["n"], rsb["connections"]["p50"],
                  rsb["connections"]["p99"], rsb["connections"]["max"]]]))
    print(f"attached {out['attached']}/{args.readers} in {out['attach_s']:.1f} s; never reconnected "
          f"{rsb['never_reconnected']}; lost {rsb['lost']}, repeated {rsb['repeated']}, wrong content "
          f"{rsb['wrong_content']}, unfinished {rsb['unfinished']}; statuses {rsb['statuses']}, errors "
          f"{rsb['n_errors']} {rsb['errors'][:2]}; pod A exited {out['pod_a_exit_s']:.1f} s after SIGTERM; "
          f"pod B {rsb['pod_b_cores_reconnect']:.2f} cores, load process {rsb['load_cores_reconnect']:.2f} cores "
          f"while they reconnected; load process {rsb['load_us_per_event']:.1f} us per event received (whole run)")
    met_t = t["p99"] <= 5.0 and rsb["never_reconnected"] == 0
    out["goals"] = {"p99_le_5s": met_t, "none_lost": rsb["lost"] == 0, "none_repeated": rsb["repeated"] == 0}
    print_goals("reconnect", [
        goal_row("drain -> next event, p99 (s)", t["p99"], "<= 5 s, every reader", met_t),
        goal_row("events lost", rsb["lost"], "0", rsb["lost"] == 0 and rsb["wrong_content"] == 0),
        goal_row("events repeated", rsb["repeated"], "0", rsb["repeated"] == 0),
    ])
    return out
