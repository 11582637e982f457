"""Token budgets over HTTP, with a real consumer and a keys file: 20 concurrent creates at the edge of a key's budget
get exactly what it holds, the rest 429 budget_exceeded with a Retry-After to the end of the UTC day and nothing
queued; OpenAI's SDK sees insufficient_quota and does not retry; another key is untouched. No generator runs: the
accepted creates stay queued, their reservations held."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from helpers import metric
from servers import StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import queue_stats_key
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

BUDGET, MAX_TOKENS = 100_000, 20_000


def test_concurrent_creates_at_the_edge_of_a_budget(stack_factory: StackFactory, redis_server: RedisServer,
                                                     redis_client: redis.Redis, tmp_path: Path) -> None:
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**alice_entry, "token_budget": BUDGET, "budget_period": "day"},
                                            bob_entry]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--max-tokens-limit", str(MAX_TOKENS), "--default-model", "m")
    headers = {"Authorization": f"Bearer {alice}"}

    def create(_: int) -> httpx.Response:
        with s.client() as c:
            return c.post("/v1/streams", json={"id": str(uuid.uuid4()), "prompt": "Hello", "max_tokens": MAX_TOKENS},
                          headers=headers)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(create, range(20)))
    created = [r for r in answers if r.status_code == 201]
    refused = [r for r in answers if r.status_code == 429]
    assert len(created) + len(refused) == 20, [r.text for r in answers]
    held = int(redis_client.hget(f"rsb:{{p0}}:s:{created[0].json()['id']}:meta", "bres") or 0)
    assert MAX_TOKENS < held < MAX_TOKENS + 200
    assert len(created) == BUDGET // held  # exactly what the budget holds, whatever the races
    end = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp() + 86_400
    for r in refused:
        assert r.json()["error"]["code"] == "budget_exceeded", r.text
        assert abs(int(r.headers["retry-after"]) - (end - time.time())) < 10
    assert int(redis_client.hget(queue_stats_key(0, 1), "waiting") or 0) == len(created)  # nothing else queued

    sdk = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=alice, max_retries=3)
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS)
    assert caught.value.code == "budget_exceeded" and caught.value.type == "insufficient_quota"
    assert time.monotonic() - started < 5, "the SDK retried a refusal no retry fixes"

    with s.client() as c:
        other = c.post("/v1/streams", json={"prompt": "Hello", "max_tokens": MAX_TOKENS},
                       headers={"Authorization": f"Bearer {bob}"})
        assert other.status_code == 201, other.text
        assert metric(c.get("/metrics", headers=headers).text, "rsb_budget_exceeded_total") == len(refused) + 1
