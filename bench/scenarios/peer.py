"""peer: the same resume and crash scenarios on Vercel's resumable-stream (Node 20), same Redis.

resumable-stream keeps a stream's chunks in the producing process's memory; Redis carries only a
sentinel key and pub/sub (a resumer publishes a request, the producer answers with everything after
``skipCharacters`` in one message, then forwards new chunks). bench/peer/server.mjs puts it behind
HTTP so the same Python load process drives both. Two Node processes: the producer and the resumer.

1. resume: a live (unfinished) stream of 4,096 chunks; reconnect at the middle (2,048 remaining);
   time from request to the last of them, content checked. rsb: a live stream of 4,096 events, resumed
   with Last-Event-ID at the middle (bench/scenarios/resume.py measures rsb's finished-stream case;
   resumable-stream cannot resume a finished stream: it answers null).
2. crash: the producer is SIGKILLed after 2,048 chunks/tokens. What does a reader attached before the
   kill get, and a reader that reconnects after it? rsb: paced generators (lease 2 s); the one that owns
   the stream is killed; the other takes over.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import procs
from bench.loadproc import Control
from bench.paced_engine import parse_tokens
from bench.prefill import prefill
from bench.report import goal_row, print_goals, table
from bench.scenarios.resume import resume_once
from bench.sseclient import client, frames
from bench.stats import summarize
from broker.redis.server import free_port

PEER_DIR = Path(__file__).resolve().parent.parent / "peer"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=int, default=4096, help="chunks/events per stream (default 4096)")
    p.add_argument("--tries", type=int, default=50, help="resumes measured per system (default 50)")


def ensure_peer() -> str | None:
    """None when the Node side is ready, else why not (npm install runs once, into bench/peer/node_modules)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node/npm not on PATH"
    if not (PEER_DIR / "node_modules" / "resumable-stream").is_dir():
        r = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=PEER_DIR, capture_output=True,
                           text=True, timeout=600)
        if r.returncode != 0:
            return f"npm install failed: {r.stderr[-1000:]}"
    return None


def start_peer(redis_url: str, name: str) -> tuple[procs.Proc, str]:
    port = free_port()
    p = procs.Proc(["node", str(PEER_DIR / "server.mjs"), str(port)], name, env={"REDIS_URL": redis_url})
    p.wait_for_line("peer server ready")
    return p, f"http://127.0.0.1:{port}"


async def _read_text(http: httpx.AsyncClient, url: str, params: dict[str, Any], want: int,
                     timeout_s: float) -> tuple[int, bytes, float]:
    """(status, body, ms until ``want`` bytes or the end) of one GET."""
    t0 = time.time()
    body = b""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("GET", url, params=params) as r:
                async for chunk in r.aiter_raw():
                    body += chunk
                    if len(body) >= want:
                        break
                return r.status_code, body, (time.time() - t0) * 1000
    except TimeoutError:
        return -1, body, (time.time() - t0) * 1000


async def load_peer_resume(ctl: Control, producer: str, resumer: str, chunks: int, tries: int) -> dict[str, Any]:
    lat: list[float] = []
    bad = 0
    text = "".join(f'data: {{"text":" tok{i}"}}\n\n' for i in range(chunks))
    skip = len("".join(f'data: {{"text":" tok{i}"}}\n\n' for i in range(chunks // 2)))
    expected = text[skip:].encode()
    async with client(keepalive=False) as http:
        for i in range(tries + 5):
            sid = str(uuid.uuid4())
            r = await http.get(f"{producer}/produce", params={"id": sid, "chunks": chunks})
            assert r.status_code == 200, r.text
            status, body, ms = await _read_text(http, f"{resumer}/resume", {"id": sid, "skip": skip},
                                                len(expected), 30)
            if i >= 5:
                lat.append(ms)
                bad += 0 if (status == 200 and body == expected) else 1
    return {"last_chunk_ms": summarize(lat), "incorrect": bad}


async def load_rsb_live_resume(ctl: Control, base: str, sid: str, event_ids: list[str],
                               tries: int) -> dict[str, Any]:
    mid = len(event_ids) // 2
    lasts, bad = [], 0
    async with client(keepalive=False) as http:
        for i in range(tries + 5):
            _, last, ok = await resume_once(http, base, sid, event_ids[mid - 1], event_ids[mid:])
            if i >= 5:
                lasts.append(last)
                bad += 0 if ok else 1
    return {"last_event_ms": summarize(lasts), "incorrect": bad}


async def load_peer_crash(ctl: Control, producer: str, resumer: str, chunks: int) -> dict[str, Any]:
    half = chunks // 2
    sid = str(uuid.uuid4())
    async with client(keepalive=False) as http:
        r = await http.get(f"{producer}/produce", params={"id": sid, "chunks": half})
        produced = r.json()
        live_bytes = 0
        live_end = "open"

        async def live() -> None:
            nonlocal live_bytes, live_end
            try:
                async with http.stream("GET", f"{resumer}/resume", params={"id": sid, "skip": 0}) as resp:
                    async for chunk in resp.aiter_raw():
                        live_bytes += len(chunk)
                live_end = "closed"
            except httpx.HTTPError as e:
                live_end = f"error {e!r}"

        task = asyncio.create_task(live())
        await asyncio.sleep(1.0)
        before = live_bytes
        ctl.mark("kill", pid=produced["pid"])
        await ctl.wait_go()
        status, body, ms = await _read_text(http, f"{resumer}/resume", {"id": sid, "skip": 0}, 1 << 30, 30)
        await asyncio.sleep(5.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return {"produced_chars": produced["chars"], "live_reader_bytes_before_kill": before,
            "live_reader_bytes_5s_after": live_bytes, "live_reader_end": live_end,
            "resume_after_kill": {"status": status, "body": body.decode(errors="replace")[:200],
                                  "bytes": len(body), "ms": ms}}


async def _collect(http: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float,
                   t0: float) -> dict[str, Any]:
    toks: list[int] = []
    times: list[float] = []
    end = "open"
    ids: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("GET", url, headers=headers) as r:
                async for f in frames(r):
                    if f.event == b"delta":
                        for i, _ in parse_tokens(f.data[9:-2].decode()):
                            toks.append(i)
                            times.append(f.t - t0)
                    if f.id:
                        ids.append(f.id.decode())
                    if f.event in (b"done", b"cancelled", b"error"):
                        end = f.event.decode()
                        break
    except TimeoutError:
        end = "timeout"
    return {"tokens": toks, "times": times, "end": end, "ids": ids}


async def load_rsb_crash(ctl: Control, base: str, redis_url: str, tokens: int) -> dict[str, Any]:
    half = tokens // 2
    async with client() as http:
        r = await http.post(f"{base}/v1/streams", json={"prompt": "crash", "max_tokens": tokens})
        sid = r.json()["id"]
        url = f"{base}/v1/streams/{sid}/events"
        t0 = time.time()
        live = asyncio.create_task(_collect(http, url, {}, 120, t0))
        while True:  # until the owner has appended half the tokens
            await asyncio.sleep(0.02)
            st = redis.Redis.from_url(redis_url)
            meta = [k for k in st.scan_iter(f"*{sid}:meta")]
            seq = int(st.hget(meta[0], "seq") or 0) if meta else 0
            worker = (st.hget(meta[0], "worker") or b"").decode() if meta else ""
            st.close()
            if seq >= half:
                break
        ctl.mark("kill", worker=worker)
        await ctl.wait_go()
        t_kill = time.time() - t0
        # A reader reconnecting after the crash, at the middle of what was appended.
        events = [e for e in (await _collect(http, url, {}, 5, t0))["ids"]]
        after = events[len(events) // 2] if len(events) > 2 else events[0]
        t1 = time.time()
        again = await _collect(http, url, {"Last-Event-ID": after}, 120, t1)
        got = await live
    first_after = again["tokens"][0] if again["tokens"] else None
    gap = [b - a for a, b in zip(got["times"], got["times"][1:], strict=False)]

    def contiguous(toks: list[int], start: int) -> bool:
        return toks == list(range(start, tokens))

    return {"killed_at_s": t_kill, "tokens_appended_before_kill": half,
            "live_reader": {"end": got["end"], "tokens": len(got["tokens"]), "exactly_once_in_order":
                            contiguous(got["tokens"], 0), "longest_gap_s": max(gap) if gap else None},
            "resumed_reader": {"end": again["end"], "tokens": len(again["tokens"]),
                               "exactly_once_in_order": first_after is not None and contiguous(again["tokens"],
                                                                                               first_after),
                               "stored_replayed_ms": (again["times"][again["tokens"].index(half - 1)] * 1000
                                                      if half - 1 in again["tokens"] else None),
                               "complete_s": again["times"][-1] if again["times"] else None}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"chunks": args.chunks, "tries": args.tries}}
    why = ensure_peer()
    out["peer_version"] = None
    if why is None:
        import json

        pkg = json.loads((PEER_DIR / "node_modules" / "resumable-stream" / "package.json").read_text())
        out["peer_version"] = pkg["version"]
    with procs.redis_server() as server, procs.procs() as started:
        # rsb, live stream resume
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        (live,) = prefill(server.url, 1, args.chunks, finish=False)
        out["rsb_resume"] = procs.run_load("bench.scenarios.peer:load_rsb_live_resume",
                                           {"base": base, "sid": live["id"], "event_ids": live["event_ids"],
                                            "tries": args.tries})
        # rsb, crash: two paced generators, the stream's owner is SIGKILLed half-way.
        gens = []
        for _ in range(2):
            gens.append(procs.start_paced_generator(server.url, workers=1, tokens_per_s=400,
                                                    extra=("--lease-s", "2", "--log-level", "info")))
            started.append(gens[-1])
        load = procs.Load("bench.scenarios.peer:load_rsb_crash",
                          {"base": base, "redis_url": server.url, "tokens": args.chunks})
        try:
            worker = load.wait_mark("kill", 120)["worker"]
            victim = next(g for g in gens if f"-{g.pid}-" in worker)
            victim.kill()
            load.go()
            out["rsb_crash"] = load.finish(300)
        finally:
            load.kill()
        if why is not None:
            out["peer_skipped"] = why
            print(f"peer skipped: {why}")
        else:
            producer, pbase = start_peer(server.url, "peer-producer")
            started.append(producer)
            resumer, rbase = start_peer(server.url, "peer-resumer")
            started.append(resumer)
            out["peer_resume"] = procs.run_load("bench.scenarios.peer:load_peer_resume",
                                                {"producer": pbase, "resumer": rbase, "chunks": args.chunks,
                                                 "tries": args.tries})
            load = procs.Load("bench.scenarios.peer:load_peer_crash",
                              {"producer": pbase, "resumer": rbase, "chunks": args.chunks})
            try:
                load.wait_mark("kill", 60)
                os.kill(producer.pid, signal.SIGKILL)
                producer.proc.wait()
                load.go()
                out["peer_crash"] = load.finish(120)
            finally:
                load.kill()
    _print(out, args)
    return out


def _print(out: dict[str, Any], args: argparse.Namespace) -> None:
    rr = out["rsb_resume"]["last_event_ms"]
    rows = [["rsb 0.1 (SSE, Redis Streams)", rr["p50"], rr["p99"], rr["max"], out["rsb_resume"]["incorrect"]]]
    if "peer_resume" in out:
        pr = out["peer_resume"]["last_chunk_ms"]
        rows.append([f"resumable-stream {out['peer_version']} (Node 20)", pr["p50"], pr["p99"], pr["max"],
                     out["peer_resume"]["incorrect"]])
    print(table(f"\n== peer 1: resume a live {args.chunks}-chunk stream at the middle (ms to the last chunk)",
                ["system", "p50", "p99", "max", "incorrect"], rows))
    rc = out["rsb_crash"]
    crash_rows = [["rsb: reader attached before the kill", f"{rc['live_reader']['tokens']} tokens, end="
                   f"{rc['live_reader']['end']}, exactly once in order: {rc['live_reader']['exactly_once_in_order']},"
                   f" longest pause {rc['live_reader']['longest_gap_s']:.1f} s"],
                  ["rsb: reader reconnecting after the kill", f"{rc['resumed_reader']['tokens']} tokens, end="
                   f"{rc['resumed_reader']['end']}, exactly once in order: "
                   f"{rc['resumed_reader']['exactly_once_in_order']}, complete after "
                   f"{rc['resumed_reader']['complete_s']:.1f} s"]]
    if "peer_crash" in out:
        pc = out["peer_crash"]
        crash_rows += [["resumable-stream: reader attached before the kill",
                        f"{pc['live_reader_bytes_before_kill']} bytes before, {pc['live_reader_bytes_5s_after']} "
                        f"5 s after; connection {pc['live_reader_end']}"],
                       ["resumable-stream: reader reconnecting after the kill",
                        f"HTTP {pc['resume_after_kill']['status']} after {pc['resume_after_kill']['ms']:.0f} ms, "
                        f"{pc['resume_after_kill']['bytes']} bytes: {pc['resume_after_kill']['body'][:60]!r}"]]
    print(table(f"\n== peer 2: producer SIGKILLed after {args.chunks // 2} of {args.chunks}", ["reader", "gets"],
                crash_rows))
    ok = rc["resumed_reader"]["exactly_once_in_order"] and rc["resumed_reader"]["end"] == "done"
    out["goals"] = {"rsb_recovers_from_crash": ok}
    goals = [goal_row("rsb stream completes exactly once after the crash", float(ok), "yes", ok)]
    if "peer_resume" in out:
        peer_p50 = out["peer_resume"]["last_chunk_ms"]["p50"]
        out["goals"]["resume_p50_le_peer"] = rr["p50"] <= peer_p50
        goals.append(goal_row("rsb resume p50 (ms)", rr["p50"], f"<= {peer_p50:.2f} (the peer's)",
                              rr["p50"] <= peer_p50))
    print_goals("peer", goals)
