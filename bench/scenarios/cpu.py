"""cpu: broker CPU seconds per 1,000 delivered tokens vs streaming SSE straight from the engine.

rsb: the consumer + the paced-generator process (``--streams`` Worker loops over the deterministic paced
engine: inference costs nothing, so what is left is the broker), Redis reported apart. Direct (the naive
design rsb replaces): one Starlette/uvicorn process running the same paced engine in-process with the same
thread hand-off, streaming SSE straight to the client (bench/direct_app.py). Same load process code:
``--streams`` concurrent streams of ``--tokens`` tokens at ``--rate`` tokens/s, each read to its end;
CPU is counted from before the first request to the last token; tokens are counted at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench import procs
from bench.loadproc import Control
from bench.report import goal_row, print_goals, table
from bench.sampling import CpuWindow
from bench.sseclient import client, create_stream, frames
from bench.stats import ratio


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=200, help="concurrent streams (default 200)")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream (default 20)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream (default 200: 10 s)")
    p.add_argument("--threaded", action="store_true",
                   help="the paced engine in a thread per generation on both sides (as llama.cpp runs)")


async def load_streams(ctl: Control, base: str, direct: bool, streams: int, tokens: int,
                       rate: float) -> dict[str, Any]:
    counts = [0] * streams
    ends: list[bytes] = []
    finished: list[int] = []
    sem = asyncio.Semaphore(50)
    await ctl.wait_go()
    t0 = time.monotonic()
    async with client() as http:

        async def one(i: int) -> None:
            async with sem:
                if direct:
                    url = f"{base}/stream?max_tokens={tokens}"
                else:
                    url = f"{base}/v1/streams/{await create_stream(http, base, max_tokens=tokens)}/events"
            async with http.stream("GET", url) as r:
                async for f in frames(r):
                    if f.event == b"delta":
                        counts[i] += f.data.count(b" ")
                        if counts[i] >= tokens:
                            finished.append(i)
                            if len(finished) == streams:
                                ctl.mark("delivered", seconds=time.monotonic() - t0)
                    elif f.event is not None and f.event not in (b"queued", b"started"):
                        ends.append(f.event)
                        return

        # A stream that has not ended long after its last token is reported, not waited for forever.
        limit = tokens / rate + 60.0
        await asyncio.gather(*(asyncio.wait_for(one(i), limit) for i in range(streams)), return_exceptions=True)
    if len(finished) < streams:
        ctl.mark("delivered", seconds=time.monotonic() - t0)
    return {"tokens": sum(counts), "wall_s": time.monotonic() - t0, "ends": sorted(set(e.decode() for e in ends)),
            "streams_ended": len(ends), "streams_not_ended": streams - len(ends)}


def _drive(base: str, direct: bool, args: argparse.Namespace, pids: list[int],
           redis_pid: int | None) -> dict[str, Any]:
    load = procs.Load("bench.scenarios.cpu:load_streams",
                      {"base": base, "direct": direct, "streams": args.streams, "tokens": args.tokens,
                       "rate": args.rate})
    try:
        time.sleep(1.0)
        cpu = CpuWindow(pids).start()
        rcpu = CpuWindow([redis_pid]).start() if redis_pid else None
        load.go()
        load.wait_mark("delivered", args.tokens / args.rate + 300)  # every token at the client
        cpu.stop()
        if rcpu:
            rcpu.stop()
        res: dict[str, Any] = load.finish(300)
    finally:
        load.kill()
    res["cpu_s"] = cpu.cpu_s
    res["cpu_s_per_1000_tokens"] = cpu.cpu_s / max(1, res["tokens"]) * 1000
    if rcpu:
        res["redis_cpu_s"] = rcpu.cpu_s
        res["redis_cpu_s_per_1000_tokens"] = rcpu.cpu_s / max(1, res["tokens"]) * 1000
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"streams": args.streams, "rate": args.rate, "tokens": args.tokens,
                                      "threaded": args.threaded},
                           "engine": "paced (deterministic, bench/paced_engine.py), "
                                     + ("a thread per generation" if args.threaded else "on the event loop")}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        threaded = ("--threaded",) if args.threaded else ()
        gen = procs.start_paced_generator(server.url, workers=args.streams, tokens_per_s=args.rate, extra=threaded)
        started.append(gen)
        assert server.proc is not None
        out["rsb"] = _drive(base, False, args, [consumer.pid, gen.pid], server.proc.pid)
        gen.stop()
        consumer.stop()
        direct, dbase = procs.start_direct(args.rate, *threaded)
        started.append(direct)
        out["direct"] = _drive(dbase, True, args, [direct.pid], None)
    rsb, direct_res = out["rsb"], out["direct"]
    out["ratio"] = r = ratio(rsb["cpu_s_per_1000_tokens"], direct_res["cpu_s_per_1000_tokens"])
    print(table(f"\n== cpu: {args.streams} streams x {args.tokens} tokens at {args.rate:g} tokens/s (paced engine)",
                ["design", "tokens", "CPU s", "CPU s / 1000 tokens", "ends", "wall s"],
                [["rsb (consumer + worker process)", rsb["tokens"], rsb["cpu_s"], rsb["cpu_s_per_1000_tokens"],
                  ",".join(rsb["ends"]), rsb["wall_s"]],
                 ["  + Redis (not in the goal)", "", rsb["redis_cpu_s"], rsb["redis_cpu_s_per_1000_tokens"], "", ""],
                 ["direct SSE from the engine", direct_res["tokens"], direct_res["cpu_s"],
                  direct_res["cpu_s_per_1000_tokens"], ",".join(direct_res["ends"]), direct_res["wall_s"]]]))
    if rsb["streams_not_ended"]:
        print(f"rsb: {rsb['streams_not_ended']} stream(s) never got their terminal event (see docs/benchmarks.md)")
    out["goals"] = {"le_1_3x_direct": r <= 1.3}
    print_goals("cpu", [goal_row("rsb / direct CPU per token", r, "<= 1.3x", r <= 1.3, "x")])
    return out
