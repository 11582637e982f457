"""soak: ``--duration`` minutes of mixed create / read / resume / cancel on one consumer.

Streams arrive at ``--rate``/s (paced engine, ``--workers`` Worker loops at ``--tokens-per-s``). Each is
one of: read to the end (60%), read, disconnect half-way and resume with Last-Event-ID (20%; checked:
every token once, in order), cancel half-way (15%), or created and never read (5%). The consumer runs
with a short ``--retention-s``. Sampled every second: consumer RSS and Redis ``used_memory``.
Goals: no RSS growth after warm-up (mean of the last fifth of the run vs the fifth right after the
warm-up quarter: <= 5%), and Redis memory back to its baseline once retention has passed.
Reference: the baseline itself (Redis and the consumer before the first stream).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx
import redis

from bench import procs
from bench.loadproc import Control
from bench.paced_engine import parse_tokens
from bench.report import goal_row, print_goals, table
from bench.sampling import Sampler, redis_used_memory
from bench.sseclient import client, frames
from bench.stats import ratio


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=1.0, help="minutes of load (default 1)")
    p.add_argument("--rate", type=float, default=10.0, help="new streams per second (default 10)")
    p.add_argument("--workers", type=int, default=64, help="concurrent generations (default 64)")
    p.add_argument("--tokens-per-s", type=float, default=50.0, help="paced engine rate (default 50)")
    p.add_argument("--retention-s", type=int, default=10, help="consumer --retention-s (default 10)")


async def _read(http: httpx.AsyncClient, url: str, headers: dict[str, str], stop_after: int | None,
                cancel_url: str | None) -> tuple[list[int], str, str | None]:
    """Token indexes read, how the read ended, and the last event id."""
    toks: list[int] = []
    last: str | None = None
    end = "eof"
    cancelling = cancel_url is not None
    async with http.stream("GET", url, headers=headers) as r:
        if r.status_code != 200:
            return toks, f"http {r.status_code}", last
        async for f in frames(r):
            if f.id:
                last = f.id.decode()
            if f.event == b"delta":
                toks += [i for i, _ in parse_tokens(f.data[9:-2].decode())]
                if stop_after is not None and len(toks) >= stop_after:
                    if cancelling:
                        if cancel_url:  # once; then read on to the terminal event
                            await http.post(cancel_url)
                            cancel_url = None
                        continue
                    return toks, "disconnected", last
            elif f.event in (b"done", b"cancelled", b"error"):
                return toks, f.event.decode(), last
    return toks, end, last


async def load_soak(ctl: Control, base: str, duration_s: float, rate: float) -> dict[str, Any]:
    rng = random.Random(1)
    counts: dict[str, int] = {}
    problems: list[str] = []

    def count(k: str) -> None:
        counts[k] = counts.get(k, 0) + 1

    async with client(timeout_s=120) as http:

        async def one(kind: str) -> None:
            n = rng.randint(20, 60)
            try:
                r = await http.post(f"{base}/v1/streams", json={"prompt": "soak", "max_tokens": n})
                if r.status_code != 201:
                    problems.append(f"create {r.status_code}")
                    return
                sid = r.json()["id"]
                url = f"{base}/v1/streams/{sid}/events"
                if kind == "create_only":
                    count(kind)
                    return
                if kind == "read":
                    toks, end, _ = await _read(http, url, {}, None, None)
                    ok = end == "done" and toks == list(range(n))
                elif kind == "resume":
                    first, end1, last = await _read(http, url, {}, n // 2, None)
                    rest, end, _ = await _read(http, url, {"Last-Event-ID": last or ""}, None, None)
                    ok = end1 == "disconnected" and end == "done" and first + rest == list(range(n))
                else:
                    toks, end, _ = await _read(http, url, {}, n // 3, f"{base}/v1/streams/{sid}/cancel")
                    ok = end in ("cancelled", "done") and toks == list(range(len(toks)))
                count(kind if ok else f"{kind}_incorrect")
                if not ok:
                    problems.append(f"{kind}: end={end}")
            except httpx.HTTPError as e:
                problems.append(f"{kind}: {e!r}")

        ctl.mark("start")
        tasks = []
        t0 = time.monotonic()
        i = 0
        while (due := t0 + i / rate) < t0 + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            kind = rng.choices(["read", "resume", "cancel", "create_only"], [60, 20, 15, 5])[0]
            tasks.append(asyncio.create_task(one(kind)))
            i += 1
        await asyncio.gather(*tasks)
    return {"streams": i, "outcomes": counts, "problems": len(problems), "problem_samples": problems[:10]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    duration_s = args.duration * 60
    out: dict[str, Any] = {"params": {"duration_min": args.duration, "rate": args.rate, "workers": args.workers,
                                      "tokens_per_s": args.tokens_per_s, "retention_s": args.retention_s},
                           "engine": "paced (deterministic, bench/paced_engine.py)"}
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url, "--retention-s", str(args.retention_s))
        started.append(consumer)
        gen = procs.start_paced_generator(server.url, workers=args.workers, tokens_per_s=args.tokens_per_s)
        started.append(gen)
        r = redis.Redis.from_url(server.url)
        time.sleep(2.0)
        baseline = redis_used_memory(r)
        sampler = Sampler(consumer.pid, server.url).start()
        load = procs.Load("bench.scenarios.soak:load_soak", {"base": base, "duration_s": duration_s,
                                                            "rate": args.rate})
        try:
            load.wait_mark("start", 60)
            t_load = time.monotonic()
            out["load"] = load.finish(duration_s + 300)
            load_s = time.monotonic() - t_load
        finally:
            load.kill()
        # Retention runs from each stream's end; then Redis's active expiry needs a moment.
        deadline = time.monotonic() + args.retention_s + 30
        while time.monotonic() < deadline:
            time.sleep(1.0)
            if time.monotonic() > deadline - 30 and redis_used_memory(r) <= baseline * 1.05:
                break
        samples = sampler.stop()
        after = redis_used_memory(r)
        leftovers: dict[str, int] = {}
        for k in r.scan_iter(count=1000):
            name = k.decode()
            kind = name.split(":")[-1] if ":s:" in name else name
            leftovers[kind] = leftovers.get(kind, 0) + int(r.memory_usage(k) or 0)
        out["redis_leftover_bytes_by_key"] = leftovers
        r.close()
    load_samples = [s for s in samples if s["t"] <= load_s + 1.0]
    n = len(load_samples)
    warm = load_samples[n // 4: n // 4 + max(1, n // 5)]
    tail = load_samples[-max(1, n // 5):]
    rss_warm = sum(s["rss"] for s in warm) / len(warm)
    rss_tail = sum(s["rss"] for s in tail) / len(tail)
    growth = ratio(rss_tail - rss_warm, rss_warm)
    out.update({"samples": samples, "rss_after_warmup_mib": rss_warm / 2**20, "rss_end_mib": rss_tail / 2**20,
                "rss_growth": growth, "redis_baseline_bytes": baseline, "redis_after_retention_bytes": after,
                "redis_peak_bytes": max(s["redis_used_memory"] for s in samples)})
    redis_back = after <= baseline * 1.05
    print(table(f"\n== soak: {args.duration:g} min, {args.rate:g} streams/s, retention {args.retention_s} s",
                ["measure", "value"],
                [["streams", out["load"]["streams"]],
                 ["outcomes", " ".join(f"{k}={v}" for k, v in sorted(out["load"]["outcomes"].items()))],
                 ["problems", out["load"]["problems"]],
                 ["consumer RSS after warm-up (MiB)", out["rss_after_warmup_mib"]],
                 ["consumer RSS at the end (MiB)", out["rss_end_mib"]],
                 ["Redis used_memory baseline / peak / after retention (KiB)",
                  f"{baseline / 1024:.0f} / {out['redis_peak_bytes'] / 1024:.0f} / {after / 1024:.0f}"],
                 ["Redis keys left (bytes by kind)", " ".join(f"{k}={v}" for k, v in leftovers.items()) or "none"]]))
    out["goals"] = {"rss_growth_le_5pct": growth <= 0.05, "redis_back_to_baseline": redis_back,
                    "no_problems": out["load"]["problems"] == 0}
    print_goals("soak", [goal_row("consumer RSS growth after warm-up", growth * 100, "<= 5%", growth <= 0.05, "%"),
                         goal_row("Redis after retention / baseline", after / baseline, "<= 1.05", redis_back, "x"),
                         goal_row("incorrect or failed streams", out["load"]["problems"], "0",
                                  out["load"]["problems"] == 0)])
    return out
