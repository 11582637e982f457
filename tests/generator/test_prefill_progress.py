"""A long prompt reports its prefill progress as `progress` events, before the first delta."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from helpers import create, read_sse
from servers import StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


def test_a_long_prompt_sends_progress_while_it_is_processed(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator(model=slow_model)
    with s.client() as c:
        long_prompt = " ".join(["hello world"] * 700)
        full = read_sse(c, create(c, prompt=long_prompt, max_tokens=20, seed=7).json()["events_url"])
        short = read_sse(c, create(c, prompt="hello", max_tokens=20).json()["events_url"])
    types = [e.event for e in full.events]
    progress = [e.data for e in full.events if e.event == "progress"]
    assert len(progress) >= 3
    total = progress[0]["prompt_tokens"]
    assert total > 512 and all(p["prompt_tokens"] == total for p in progress)
    processed = [p["processed"] for p in progress]
    assert processed == sorted(processed) and processed[-1] == total - 1
    first_delta = types.index("delta")
    assert types.index("started") < types.index("progress") and max(
        i for i, t in enumerate(types) if t == "progress") < first_delta
    assert types[-1] == "done" and full.events[-1].data["usage"]["completion_tokens"] == 20
    assert full.events[-1].data["usage"]["prompt_tokens"] == total
    assert "progress" not in [e.event for e in short.events]  # short prompts say nothing extra
