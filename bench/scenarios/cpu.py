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
from bench.sseclient import Creator, SSEStream
from bench.stats import ratio


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=200, help="concurrent streams (default 200)")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream (default 20)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream (default 200: 10 s)")
    p.add_argument("--threaded", action="store_true",
                   help="the paced engine in a thread per generation on both sides (as llama.cpp runs)")


async def load_streams(ctl: Control, base: str, direct: bool, streams: int, tokens: int,
                       rate: float) -> dict[str, Any]:
    host, port = base.removeprefix("http://").split(":")
    counts = [0] * streams
    ends: list[bytes] = []
    finished: list[int] = []
    sem = asyncio.Semaphore(50)
    creator = Creator(host, int(port))
    await ctl.wait_go()
    t0, c0 = time.monotonic(), time.process_time()

    async def one(i: int) -> None:
        def on_frames(stream: SSEStream, frames: list[tuple[bytes | None, bytes | None, bytes]], t: float) -> None:
            for _, event, data in frames:
                if event == b"delta":
                    counts[i] += data.count(b" ")
                    if counts[i] >= tokens:
                        finished.append(i)
                        if len(finished) == streams:
                            ctl.mark("delivered", seconds=time.monotonic() - t0)
                elif event is not None and event not in (b"queued", b"started"):
                    ends.append(event)
                    stream.close()

        async with sem:
            if direct:
                path = f"/stream?max_tokens={tokens}"
            else:
                path = f"/v1/streams/{await creator.create(max_tokens=tokens)}/events"
            stream = await SSEStream.open(host, int(port), path, on_frames)
        await stream.ended

    # A stream that has not ended long after its last token is reported, not waited for forever.
    limit = tokens / rate + 60.0
    await asyncio.gather(*(asyncio.wait_for(one(i), limit) for i in range(streams)), return_exceptions=True)
    if len(finished) < streams:
        ctl.mark("delivered", seconds=time.monotonic() - t0)
    load_cpu_s = time.process_time() - c0
    await creator.aclose()
    return {"tokens": sum(counts), "wall_s": time.monotonic() - t0, "ends": sorted(set(e.decode() for e in ends)),
            "streams_ended": len(ends), "streams_not_ended": streams - len(ends),
            "load_us_per_token": load_cpu_s / max(1, sum(counts)) * 1e6}


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
    print(f"load process (the same client for both): {rsb['load_us_per_token']:.1f} us per token with rsb, "
          f"{direct_res['load_us_per_token']:.1f} with direct SSE")
    if rsb["streams_not_ended"]:
        print(f"rsb: {rsb['streams_not_ended']} stream(s) never got their terminal event (see docs/benchmarks.md)")
    out["goals"] = {"le_1_5x_direct": r <= 1.5}  # issue 24's goal
    print_goals("cpu", [goal_row("rsb / direct CPU per token", r, "<= 1.5x", r <= 1.5, "x")])
    return out
