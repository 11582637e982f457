"""Budgets over HTTP, with real consumers and a keys file: 20 concurrent creates at the edge of a key's budget (in
tokens, in USD; a team's, over its keys; spread over two pods) get exactly what it holds, the rest 429
budget_exceeded with a Retry-After to the end of the period and nothing queued; OpenAI's SDK sees insufficient_quota
and does not retry; another key is untouched. No generator runs: the accepted creates stay queued, their
reservations held."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
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


def test_a_usd_budget_and_a_team_budget_hold_across_two_pods(stack_factory: StackFactory, redis_server: RedisServer,
                                                              redis_client: redis.Redis, tmp_path: Path) -> None:
    """Budgets in money (``usd_budget``, priced by --prices) and a team's (``team`` + --teams), 20 concurrent creates
    each, spread over two pods: exactly what each budget holds is admitted, never one more."""
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    carol, carol_entry = new_key("carol")
    dave, dave_entry = new_key("dave")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**alice_entry, "usd_budget": 1.0}, {**bob_entry, "team": "blue"},
                                            {**carol_entry, "team": "blue"}, {**dave_entry, "team": "red"}]}))
    teams = tmp_path / "teams.json"
    teams.write_bytes(orjson.dumps({"blue": {"token_budget": BUDGET, "budget_period": "day"},
                                    "red": {"usd_budget": 5.0, "budget_period": "month"}}))
    prices = tmp_path / "prices.json"
    prices.write_bytes(orjson.dumps({"m": {"input_per_mtok": 1.0, "output_per_mtok": 10.0}}))
    s = stack_factory(redis_server.url)
    flags = ("--api-keys", str(keys), "--teams", str(teams), "--prices", str(prices), "--max-tokens-limit",
             str(MAX_TOKENS), "--default-model", "m")
    pods = [s.consumer(*flags)[1], s.consumer(*flags)[1]]

    def burst(tokens: list[str]) -> list[httpx.Response]:
        def create(i: int) -> httpx.Response:
            with s.client(pods[i % 2]) as c:
                return c.post("/v1/streams", json={"id": str(uuid.uuid4()), "prompt": "Hello",
                                                   "max_tokens": MAX_TOKENS},
                              headers={"Authorization": f"Bearer {tokens[i % len(tokens)]}"})

        with ThreadPoolExecutor(20) as pool:
            return list(pool.map(create, range(20)))

    def meta(r: httpx.Response, name: str) -> int:
        return int(redis_client.hget(f"rsb:{{p0}}:s:{r.json()['id']}:meta", name) or 0)

    usd = burst([alice])
    created = [r for r in usd if r.status_code == 201]
    held = meta(created[0], "bures")  # nano-USD: the prompt's bytes at $1/M and 20,000 tokens at $10/M
    assert 0.2 * 1e9 < held < 0.2002 * 1e9
    assert len(created) == 10**9 // held == 4, [r.text for r in usd]  # exactly what $1.00 holds
    month_end = _period_end("month")
    for r in usd:
        if r.status_code != 201:
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded", r.text
            assert "this API key's budget ($1 a month)" in r.json()["error"]["message"]
            assert abs(int(r.headers["retry-after"]) - (month_end - time.time())) < 10

    team = burst([bob, carol])
    created_team = [r for r in team if r.status_code == 201]
    tokens = meta(created_team[0], "bres")
    assert len(created_team) == BUDGET // tokens == 4, [r.text for r in team]  # the team's, over both keys
    day_end = _period_end("day")
    for r in team:
        if r.status_code != 201:
            assert r.status_code == 429 and "team blue's token budget" in r.json()["error"]["message"], r.text
            assert abs(int(r.headers["retry-after"]) - (day_end - time.time())) < 10
    assert int(redis_client.hget(queue_stats_key(0, 1), "waiting") or 0) == 8  # nothing else queued

    with s.client(pods[1]) as c:  # a key of another team: its own team's budget, far from its end
        assert c.post("/v1/streams", json={"prompt": "Hello", "max_tokens": MAX_TOKENS},
                      headers={"Authorization": f"Bearer {dave}"}).status_code == 201


def _period_end(period: str) -> float:
    now = datetime.now(UTC)
    if period == "day":
        return now.replace(hour=0, minute=0, second=0, microsecond=0).timestamp() + 86_400
    nxt = now.replace(day=28) + timedelta(days=4)
    return nxt.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def test_budgets_that_cannot_be_kept_stop_the_start(tmp_path: Path) -> None:
    _, entry = new_key("alice")
    keys = tmp_path / "keys.json"
    for extra, flags, says in (({"usd_budget": 1.0}, (), "--prices"), ({"team": "blue"}, (), "--teams")):
        keys.write_bytes(orjson.dumps({"keys": [{**entry, **extra}]}))
        r = subprocess.run([sys.executable, "-m", "rsb", "consumer", "--redis-url", "redis://127.0.0.1:9/0",
                            "--api-keys", str(keys), *flags], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and says in r.stderr, r.stderr
