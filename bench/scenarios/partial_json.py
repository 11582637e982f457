"""partial-json: the partial value of a structured answer after every delta, incremental vs re-parsed.

A 12 KB JSON answer (a list of search results, pretty-printed as models write it) arrives in ~1,600 deltas of
1-14 characters. After each delta a client wants the value so far (to show it). Three ways, same run, same
deltas, each checked to end with json.loads's value:
- ``incremental``: rsb's parser (rsb._partial_json.PartialJSON) fed each delta, its value read after each;
- ``client``: the same through the client's ``Answer`` (feed the event, read ``answer.parsed``);
- ``naive``: the accumulated text re-parsed after every delta by the same parser (O(n) per delta);
- ``jiter``: the accumulated text re-parsed by jiter (Rust, ``partial_mode="trailing-strings"``), what the
  openai SDK's stream helpers do with tool arguments: the naive way with a fast parser, for reference.

Per-delta cost is the median over the 21 deltas around delta 100 and around delta 1,500, median of the
repeats. Goals: incremental cost at delta 1,500 <= 2x that at delta 100; total >= 100x faster than naive.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.report import goal_row, print_goals, table
from rsb import Answer, Event
from rsb._partial_json import PartialJSON

WINDOW = 10  # deltas each side of the one measured


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-kb", type=float, default=12.0, help="size of the JSON answer (default 12 KB)")
    p.add_argument("--deltas", type=int, default=1600, help="deltas it arrives in (default 1,600)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each way (default 3)")
    p.add_argument("--seed", type=int, default=3)


def answer_text(size: int, rng: random.Random) -> str:
    """A structured answer of about ``size`` characters."""
    words = ("stream redis resume token event reader client failover replica cursor durable answer "
             "latency batch queue worker lease fence append replay tail browser model").split()
    results: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"query": "resumable streams for LLM output", "total": 0, "results": results}
    while len(json.dumps(doc, indent=2, ensure_ascii=False)) < size:
        i = len(results)
        results.append({
            "id": i, "title": " ".join(rng.choice(words) for _ in range(4)).capitalize(),
            "url": f"https://example.org/{rng.choice(words)}/{i}", "score": round(rng.random(), 4),
            "tags": [rng.choice(words) for _ in range(3)], "fresh": rng.random() < 0.5,
            "summary": " ".join(rng.choice(words) for _ in range(12)) + ". \u00e9t\u00e9 \u2014 ok",
        })
        doc["total"] = len(results)
    return json.dumps(doc, indent=2, ensure_ascii=False)


def split(text: str, deltas: int, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), deltas - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def incremental(pieces: list[str]) -> tuple[list[int], Any]:
    p = PartialJSON()
    costs = []
    clock = time.perf_counter_ns
    for piece in pieces:
        t0 = clock()
        p.feed(piece)
        p.value  # noqa: B018  (reading it is part of the cost: it joins the open string)
        costs.append(clock() - t0)
    p.end()
    return costs, p.value


def client(pieces: list[str]) -> tuple[list[int], Any]:
    answer = Answer()
    events = [Event(f"{i + 1}-0", "delta", {"text": piece}) for i, piece in enumerate(pieces)]
    costs = []
    clock = time.perf_counter_ns
    for event in events:
        t0 = clock()
        answer.feed(event)
        answer.parsed  # noqa: B018
        costs.append(clock() - t0)
    answer.feed(Event(f"{len(pieces) + 1}-0", "done", {"finish_reason": "stop", "usage": {}}))
    return costs, answer.parsed


def naive(pieces: list[str]) -> tuple[list[int], Any]:
    costs = []
    text = ""
    value: Any = None
    clock = time.perf_counter_ns
    for piece in pieces:
        t0 = clock()
        text += piece
        p = PartialJSON()
        p.feed(text)
        value = p.value
        costs.append(clock() - t0)
    return costs, value


def jiter_way(pieces: list[str]) -> tuple[list[int], Any]:
    import jiter

    costs = []
    text = ""
    value: Any = None
    clock = time.perf_counter_ns
    for piece in pieces:
        t0 = clock()
        text += piece
        value = jiter.from_json(text.encode(), partial_mode="trailing-strings")
        costs.append(clock() - t0)
    return costs, value


def _at(costs: list[int], i: int) -> float:
    """The median cost (µs) of the deltas around delta ``i`` (counted from 1)."""
    return statistics.median(costs[max(0, i - 1 - WINDOW):i + WINDOW]) / 1000


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    text = answer_text(int(args.size_kb * 1000), rng)
    pieces = split(text, args.deltas, rng)
    final = json.loads(text)
    ways: dict[str, Callable[[list[str]], tuple[list[int], Any]]] = {
        "incremental": incremental, "client": client, "naive": naive}
    try:
        import jiter  # noqa: F401

        ways["jiter"] = jiter_way
    except ImportError:
        pass
    late = min(1500, args.deltas - WINDOW)
    out: dict[str, Any] = {"size_chars": len(text), "deltas": len(pieces), "ways": {}}
    for name, way in ways.items():
        runs = []
        for _ in range(args.repeat):
            gc.collect()
            costs, value = way(pieces)
            assert value == final, f"{name} did not end with the document"
            runs.append(costs)
        early_us = statistics.median(_at(c, 100) for c in runs)
        late_us = statistics.median(_at(c, late) for c in runs)
        total_ms = statistics.median(sum(c) for c in runs) / 1e6
        out["ways"][name] = {"at_100_us": round(early_us, 2), f"at_{late}_us": round(late_us, 2),
                             "growth": round(late_us / early_us, 2), "total_ms": round(total_ms, 2)}
        print(f"  {name}: {total_ms:.1f} ms", flush=True)
    inc = out["ways"]["incremental"]
    rows = []
    for name, r in out["ways"].items():
        rows.append([name, r["at_100_us"], r[f"at_{late}_us"], f"{r['growth']:.2f}x", r["total_ms"],
                     f"{r['total_ms'] / inc['total_ms']:.1f}x"])
    print(table(f"\n== partial-json: a {len(text):,}-character JSON answer in {len(pieces):,} deltas, value after each "
                f"(median of {args.repeat})",
                ["way", "µs/delta at 100", f"µs/delta at {late}", "growth", "total ms", "total vs incremental"],
                rows), flush=True)
    speedup = out["ways"]["naive"]["total_ms"] / inc["total_ms"]
    out["speedup_vs_naive"] = round(speedup, 1)
    print_goals("partial-json", [
        goal_row(f"incremental cost at delta {late} / at 100", inc["growth"], "<= 2x", inc["growth"] <= 2, "x"),
        goal_row("naive total / incremental total", speedup, ">= 100x", speedup >= 100, "x"),
    ])
    return out
