"""The history checker (tests/fault_schedule.py) in the suite: a minute of randomized network and process faults over
16 streams, every reader's history held to its stream. ``RSB_FAULT_SEED`` replays a run, ``RSB_FAULT_SECONDS``
lengthens it; ``python3 -m bench faults`` runs the same for longer and records it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fault_schedule import Deployment, run_schedule
from scripted_upstream import ScriptedUpstream, paced
from servers import StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        up.respond = paced(100)
        yield up


@pytest.mark.timeout(600)
def test_every_reader_gets_its_stream_exactly_through_random_faults(
        stack_factory: StackFactory, own_redis: RedisServer, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    deployment = Deployment(own_redis, stack_factory, upstream, tmp_path)
    client = redis.Redis(port=own_redis.port)
    try:
        out = run_schedule(deployment, client, seconds=float(os.environ.get("RSB_FAULT_SECONDS", "60")))
    finally:
        deployment.close()
        client.close()
    print(f"seed {out.seed}: {len(out.faults)} faults, {out.streams} streams ({sum(out.attempts.values())} attempts), "
          f"{out.readers} readers reconnected {out.reconnects} times: every history exact")
