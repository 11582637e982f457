"""faults: the suite's fault schedule run longer: randomized network and process faults over many streams, every
reader's history checked against its stream.

tests/fault_schedule.py (the deployment, the faults, the checks; tests/test_fault_schedule.py runs it for a minute in
the suite): a redis-server with AOF, two consumers and two generators each behind a fault proxy of its own, the
generators driving a paced scripted upstream (100 words a second). For ``--seconds`` one fault at a time, 1 to 6 s
each: 200 ms more on a link, a link half-open or partitioned, a link's connections reset, a generator SIGKILLed,
SIGSTOPped or SIGTERMed, a consumer drained, Redis restarted; ``--streams`` streams are created meanwhile, each read
by two readers that reconnect to either pod. A run passes when every stream ended ``done`` with its whole budget,
each attempt's words in order (nothing twice, nothing lost at a seam), and every reader's history is its stream's
(no gap, duplicate or reorder; each resume exact). ``--seed`` (or ``RSB_FAULT_SEED``) replays a run.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import table

ROOT = Path(__file__).resolve().parents[2]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=600.0, help="how long faults are applied (default 600)")
    p.add_argument("--streams", type=int, default=100, help="streams created meanwhile (default 100)")
    p.add_argument("--seed", type=int, default=None, help="replay a run (default: a random seed, printed)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    # The tests' own machinery (a checkout's tests/, as bench/ itself is run from a checkout).
    sys.path.insert(0, str(ROOT / "tests"))
    import redis
    from fault_schedule import Deployment, run_schedule
    from scripted_upstream import ScriptedUpstream, paced
    from servers import Stack

    from broker.redis.server import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="rsb-bench-faults-"))
    server = RedisServer(appendonly=True).start()
    stacks: list[Stack] = []

    def stack_factory(url: str) -> Stack:
        stack = Stack(url, tmp / "unused.gguf", tmp)  # the generators drive the upstream: no model is loaded
        stacks.append(stack)
        return stack

    client = redis.Redis(port=server.port)
    deployment = None
    try:
        with ScriptedUpstream() as upstream:
            upstream.respond = paced(100)
            deployment = Deployment(server, stack_factory, upstream, tmp)
            out = run_schedule(deployment, client, seconds=args.seconds, seed=args.seed, streams=args.streams)
    finally:
        if deployment is not None:
            deployment.close()
        for stack in stacks:
            stack.close()
        client.close()
        server.cleanup()
    kinds: dict[str, int] = {}
    for what in out.faults:
        kind = re.sub(r"(generator|consumer)-[ab]", "a \\1", what)
        kinds[kind] = kinds.get(kind, 0) + 1
    attempts = sum(out.attempts.values())
    print(table(f"\n== faults: {args.seconds:g} s of faults, seed {out.seed}",
                ["faults", "streams", "attempts", "readers", "reconnects", "histories exact"],
                [[len(out.faults), out.streams, attempts, out.readers, out.reconnects, "all"]]))
    print(table("faults applied", ["fault", "times"], [[k, n] for k, n in sorted(kinds.items())]))
    return {"params": {"seconds": args.seconds, "streams": args.streams, "seed": out.seed},
            "faults": out.faults, "streams": out.streams, "attempts": attempts, "readers": out.readers,
            "reconnects": out.reconnects, "histories_exact": True}
