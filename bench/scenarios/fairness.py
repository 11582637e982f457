"""fairness: one tenant's backlog against another tenant's single job, on one model's pool.

Key A queues ``--backlog`` jobs (within its limits) on a pool of ``--workers`` slots running ``--job-s`` jobs (the
paced engine: deterministic time per token); key B then creates one job. Measured: B's wait from its create to its
``started`` event, and the queue position its ``queued`` event gave. Reference, same run: B's job alone (no
backlog), and what first-come-first-served would make it wait (the backlog ahead of it over the slots: the issue's
measurement before tenants took turns was 10.8 to 11.5 s for 26 jobs on 2 slots of 1 s).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import procs
from bench.report import goal_row, print_goals, table
from consumer.edge.auth import new_key

TOKENS_PER_S = 20.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backlog", type=int, default=26, help="key A's queued jobs (default 26)")
    p.add_argument("--workers", type=int, default=2, help="slots of the pool (default 2)")
    p.add_argument("--job-s", type=float, default=1.0, help="seconds per job (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of each measurement (default 3)")


def _create(c: httpx.Client, key: str, tokens: int) -> str:
    sid = str(uuid.uuid4())
    r = c.post("/v1/streams", json={"id": sid, "prompt": "fair", "max_tokens": tokens},
               headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text
    return sid


def _until_started(c: httpx.Client, key: str, sid: str) -> tuple[float, int | None]:
    """Seconds from now until the stream's ``started`` event, and the first ``queued`` position it was told."""
    t0 = time.monotonic()
    position: int | None = None
    event = ""
    with c.stream("GET", f"/v1/streams/{sid}/events", headers={"Authorization": f"Bearer {key}"},
                  timeout=httpx.Timeout(300)) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "queued" and position is None:
                position = int(orjson.loads(line.removeprefix("data: "))["position"])
            elif line.startswith("data: ") and event == "started":
                return time.monotonic() - t0, position
    raise AssertionError("the stream ended without starting")


def _drained(c: httpx.Client, key: str, sids: list[str]) -> None:
    for sid in sids:
        while c.get(f"/v1/streams/{sid}", headers={"Authorization": f"Bearer {key}"}).json()["status"] in (
                "queued", "running"):
            time.sleep(0.1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokens = max(1, round(args.job_s * TOKENS_PER_S))
    a_key, a_entry = new_key("tenant-a")
    b_key, b_entry = new_key("tenant-b")
    alone: list[float] = []
    behind: list[float] = []
    positions: list[int | None] = []
    with tempfile.TemporaryDirectory() as tmp, procs.redis_server() as server, procs.procs() as started:
        keys = Path(tmp) / "keys.json"
        keys.write_bytes(orjson.dumps({"keys": [a_entry, b_entry]}))
        consumer, base = procs.start_consumer(server.url, "--api-keys", str(keys))
        started.append(consumer)
        started.append(procs.start_paced_generator(server.url, workers=args.workers, tokens_per_s=TOKENS_PER_S))
        with httpx.Client(base_url=base, timeout=30) as c:
            for _ in range(args.rounds):
                sid = _create(c, b_key, tokens)
                alone.append(_until_started(c, b_key, sid)[0])
                _drained(c, b_key, [sid])
            for _ in range(args.rounds):
                backlog = [_create(c, a_key, tokens) for _ in range(args.backlog)]
                sid = _create(c, b_key, tokens)
                wait, position = _until_started(c, b_key, sid)
                behind.append(wait)
                positions.append(position)
                _drained(c, a_key, backlog)
                _drained(c, b_key, [sid])
    fifo_s = args.backlog / args.workers * args.job_s
    goal_s = 2 * args.job_s
    out: dict[str, Any] = {
        "params": {"backlog": args.backlog, "workers": args.workers, "job_s": args.job_s, "rounds": args.rounds},
        "alone_s": alone, "behind_backlog_s": behind, "positions": positions, "fifo_estimate_s": fifo_s}
    print(table(f"\n== fairness: key B's one job vs key A's {args.backlog} queued, {args.workers} slots of "
                f"{args.job_s:g} s (seconds from create to started)",
                ["case", "p50", "max", "queued position"],
                [["B alone (reference)", statistics.median(alone), max(alone), "-"],
                 [f"B behind A's {args.backlog}", statistics.median(behind), max(behind),
                  ",".join(str(p) for p in positions)],
                 ["first come first served (estimate)", fifo_s, fifo_s, args.backlog + 1]]))
    worst = max(behind)
    out["ratio_to_fifo"] = worst / fifo_s
    out["goals"] = {"wait_le_one_job_per_slot": worst <= goal_s}
    print_goals("fairness", [goal_row("B's wait behind A (s, max)", worst, f"<= {goal_s:g} s", worst <= goal_s)])
    return out
