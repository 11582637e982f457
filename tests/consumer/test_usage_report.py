"""GET /v1/reports/usage and ``rsb report --usage`` over a real stack with API keys and prices: a key sees its own
records, an admin key every key's; the sums are those of the generations' own usage; cost_usd follows the prices
file; CSV and the command line say the same."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import redis
from helpers import create, eventually, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import served_models_key
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

PRICE = {"input_per_mtok": 3.0, "cached_input_per_mtok": 0.3, "output_per_mtok": 15.0}


def test_a_key_sees_its_usage_an_admin_sees_every_keys(stack_factory: StackFactory, redis_server: RedisServer,
                                                        redis_client: redis.Redis, tmp_path: Path) -> None:
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    root, root_entry = new_key("root")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry, {**root_entry, "admin": True}]}))
    s = stack_factory(redis_server.url)
    s.generator()
    def served() -> str:
        names = [n for n in cast("list[bytes]", redis_client.zrange(served_models_key(), 0, -1))
                 if not n.startswith(b"alias:")]  # the model, not the test aliases it answers to
        assert names, "no model served yet"
        return names[0].decode()

    model = eventually(served, 30)
    prices = tmp_path / "prices.json"
    prices.write_bytes(orjson.dumps({model: PRICE}))
    s.consumer("--api-keys", str(keys), "--prices", str(prices))
    as_ = {name: {"Authorization": f"Bearer {token}"} for name, token in (("alice", alice), ("bob", bob),
                                                                          ("root", root))}
    usages: dict[str, list[dict[str, int]]] = {"alice": [], "bob": []}
    with s.client() as c:
        for who, max_tokens in (("alice", 8), ("alice", 12), ("bob", 5)):
            c.headers.update(as_[who])
            sid = create(c, max_tokens=max_tokens).json()["id"]
            usages[who].append(wait_status(c, sid, {"done"})["usage"])

        def report(who: str, **params: str) -> Any:
            r = c.get("/v1/reports/usage", params=params, headers=as_[who])
            assert r.status_code == 200, r.text
            return r.json()

        mine = report("alice", group_by="key,model,status")
        want = {"streams": 2, "prompt_tokens": sum(u["prompt_tokens"] for u in usages["alice"]),
                "completion_tokens": 20, "cached_tokens": sum(u["cached_tokens"] for u in usages["alice"]),
                "wasted_tokens": 0}
        [row] = mine["rows"]
        assert (row["key"], row["model"], row["status"]) == ("alice", model, "done")
        assert {k: row[k] for k in want} == want
        cost = ((want["prompt_tokens"] - want["cached_tokens"]) * PRICE["input_per_mtok"]
                + want["cached_tokens"] * PRICE["cached_input_per_mtok"] + 20 * PRICE["output_per_mtok"]) / 1e6
        assert row["cost_usd"] == pytest.approx(cost, abs=1e-6) and row["unpriced_streams"] == 0
        assert [r["key"] for r in report("bob")["rows"]] == ["bob"]
        everyone = report("root")
        assert [(r["key"], r["streams"]) for r in everyone["rows"]] == [("alice", 2), ("bob", 1)]
        assert [r["key"] for r in report("root", key="bob")["rows"]] == ["bob"]
        for who, params in (("alice", {"key": "bob"}), ("root", {"key": "nobody"})):
            r = c.get("/v1/reports/usage", params=params, headers=as_[who])
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        for params in ({"group_by": "colour"}, {"group_by": "key,"}, {"format": "xml"}, {"since": "yesterday"}):
            r = c.get("/v1/reports/usage", params=params, headers=as_["root"])
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (params, r.text)
        assert s.client().get("/v1/reports/usage").status_code == 401
        sheet = c.get("/v1/reports/usage", params={"format": "csv", "group_by": "day,key"}, headers=as_["root"])
        assert sheet.status_code == 200 and sheet.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(sheet.text)))
        assert [(r["key"], r["streams"]) for r in rows] == [("alice", "2"), ("bob", "1")] and "cost_usd" in rows[0]

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "rsb", "report", "--usage", "--redis-url", redis_server.url,
                               *args], capture_output=True, text=True, check=True).stdout

    assert orjson.loads(cli("--json", "--prices", str(prices)))["total"] == everyone["total"]
    plain = orjson.loads(cli("--json", "--group-by", "key", "--key", "alice"))
    assert [r["key"] for r in plain["rows"]] == ["alice"] and "cost_usd" not in plain["total"]
    table = cli("--group-by", "key,status")
    assert table.splitlines()[0].split()[:3] == ["key", "status", "streams"] and "alice" in table
    bad = subprocess.run([sys.executable, "-m", "rsb", "report", "--usage", "--redis-url", redis_server.url,
                          "--group-by", "colour"], capture_output=True, text=True)
    assert bad.returncode == 2 and "group_by" in bad.stderr


def test_reports_are_rate_limited_per_caller(stack_factory: StackFactory, redis_server: RedisServer,
                                            tmp_path: Path) -> None:
    """A report costs the pod's CPU: a caller gets --report-burst of them at once, then --report-rate-per-min; another
    caller is not held up by it."""
    alice, alice_entry = new_key("alice")
    bob, bob_entry = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [alice_entry, bob_entry]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--report-burst", "3", "--report-rate-per-min", "6")
    with s.client() as c:
        a, b = {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}
        answers = [c.get(path, headers=a) for path in ("/v1/reports/usage", "/v1/reports/aborted") * 3]
        assert [r.status_code for r in answers[:3]] == [200] * 3
        # The bucket refills continuously (one report per 10 s): the fraction regained while the burst was spent may
        # let one more through.
        refused = [r for r in answers[3:] if r.status_code != 200]
        assert refused and all(r.status_code == 429 and r.json()["error"]["code"] == "rate_limited" for r in refused)
        assert 1 <= int(refused[0].headers["retry-after"]) <= 20  # at most two refills of 10 s
        assert c.get("/v1/reports/usage", headers=b).status_code == 200
