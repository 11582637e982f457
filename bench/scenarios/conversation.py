"""conversation: what a conversation's turn costs at create, against a plain create, as its history grows.

One conversation of ``--turns`` turns, each a ``POST /v1/streams`` naming it with one new message; interleaved
with it, the same number of plain creates (the reference, same run, same consumer). A paced generator answers
each in ``--answer-tokens`` tokens; the next request waits for the previous one's end (a conversation runs one
turn at a time). A turn's create reads the conversation (every finished turn: its history grows), settles it,
reserves the turn and creates the stream; a plain create is the stream's create alone. Also timed: reading the
history back (``GET /v1/conversations/{id}/turns``), what a second device does when it opens the chat.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import httpx

from bench import procs
from bench.report import table
from bench.stats import ratio, summarize

BUCKET = 10  # turns per row: the first ones, and the last ones


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=100, help="turns of the conversation (default 100)")
    p.add_argument("--answer-tokens", type=int, default=8, help="tokens per answer (default 8)")


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def _wait(http: httpx.Client, sid: str) -> None:
    while http.get(f"/v1/streams/{sid}").json()["status"] not in ("done", "cancelled", "error"):
        time.sleep(0.002)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"params": {"turns": args.turns, "answer_tokens": args.answer_tokens}}
    conv = str(uuid.uuid4())
    plain: list[float] = []
    turns: list[float] = []
    reads: list[float] = []
    with procs.redis_server() as server, procs.procs() as started:
        consumer, base = procs.start_consumer(server.url)
        started.append(consumer)
        started.append(procs.start_paced_generator(server.url, workers=1, tokens_per_s=2000.0))
        with httpx.Client(base_url=base, timeout=30) as http:
            for i in range(args.turns):
                message = [{"role": "user", "content": f"Question {i}: what comes next?"}]
                ms, r = _timed(lambda m=message: http.post(
                    "/v1/streams", json={"messages": m, "max_tokens": args.answer_tokens}))
                assert r.status_code == 201, r.text
                plain.append(ms)
                _wait(http, r.json()["id"])
                ms, r = _timed(lambda m=message: http.post(
                    "/v1/streams", json={"conversation": conv, "messages": m, "max_tokens": args.answer_tokens}))
                assert r.status_code == 201, r.text
                turns.append(ms)
                _wait(http, r.json()["id"])
                ms, r = _timed(lambda: http.get(f"/v1/conversations/{conv}/turns"))
                assert r.status_code == 200 and len(r.json()["turns"]) == i + 1, r.text
                reads.append(ms)
    first, last = slice(0, BUCKET), slice(-BUCKET, None)
    rows = {"plain create (every turn)": summarize(plain), "conversation turn, first 10": summarize(turns[first]),
            f"conversation turn, last 10 (history of {args.turns - BUCKET}+ turns)": summarize(turns[last]),
            "history read, first 10": summarize(reads[first]), "history read, last 10": summarize(reads[last])}
    out["rsb"] = rows
    print(table(f"\n== {args.turns} turns of one conversation, {args.answer_tokens}-token answers: ms per request",
                ["request", "p50", "p99", "max"], [[k, v["p50"], v["p99"], v["max"]] for k, v in rows.items()]))
    out["last_turn_to_plain_p50"] = ratio(rows[list(rows)[2]]["p50"], rows["plain create (every turn)"]["p50"])
    print(f"a turn of a {args.turns}-turn conversation / a plain create, p50: {out['last_turn_to_plain_p50']:.2f}x")
    return out
