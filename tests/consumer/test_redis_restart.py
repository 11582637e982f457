"""A real redis-server (AOF on) stopped and restarted mid-stream: nothing lost, nothing twice."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import SSERead, create, read_sse, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


def test_redis_restart_mid_stream_loses_and_repeats_nothing(stack_factory: StackFactory, own_redis: RedisServer, slow_model: Path) -> None:
    s = stack_factory(own_redis.url)
    s.consumer("--heartbeat-s", "0.5")
    s.generator("--lease-s", "5", model=slow_model)
    max_tokens = 2500
    stayed: list[SSERead] = []
    with s.client() as c:
        sid = create(c, max_tokens=max_tokens).json()["id"]
        t = threading.Thread(target=lambda: stayed.append(
            read_sse(s.client(), f"/v1/streams/{sid}/events", timeout_s=120)))
        t.start()
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=30)

        own_redis.stop()  # a clean shutdown writes the AOF; appendfsync everysec bounds a crash's loss
        t_down = time.monotonic()
        down = create(c)
        assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable"
        assert int(down.headers["retry-after"]) >= 1
        assert c.get(f"/v1/streams/{sid}").status_code == 503
        time.sleep(2.0)  # deliberate downtime: connected readers get heartbeats meanwhile, not errors
        own_redis.start()
        downtime = time.monotonic() - t_down

        tail = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": head.ids[-1]}, timeout_s=120)
        t.join(120)
        after = read_sse(c, f"/v1/streams/{sid}/events")
        wait_status(c, sid, {"done"})
    full = [(e.id, e.event, e.data) for e in after.events]
    assert [e.event for e in after.events][-1] == "done"
    assert after.events[-1].data["usage"]["completion_tokens"] == max_tokens
    ids = after.ids
    assert len(ids) == len(set(ids)) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert [(e.id, e.event, e.data) for e in stayed[0].events] == full
    assert [(e.id, e.event, e.data) for e in head.events + tail.events] == full
    # The reader that stayed connected got heartbeats while Redis was away.
    beats = [ts for ts, _ in stayed[0].comments]
    assert len(beats) >= int(downtime / 0.5) - 1
