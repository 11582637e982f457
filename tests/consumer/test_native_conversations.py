"""Conversations through the native API against real redis-server, `rsb consumer` and `rsb generator`
processes: a create naming a conversation sends only its new messages and the engine gets the whole history;
two devices sending at once make one turn and one 409; a second device reads the history back; a worker
SIGKILLed mid-answer leaves the continued answer in the history exactly once; tenants, bounds and retries."""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from helpers import eventually, read_sse, wait_status
from servers import Stack, StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import ConversationKeys, StreamKeys
from consumer.edge.auth import new_key
from rsb import Client, ConflictError

pytestmark = pytest.mark.slow

TERMINAL = {"done", "cancelled", "error"}


def engine_messages(r: redis.Redis, sid: str) -> list[dict[str, Any]]:
    """The messages the engine was given for a stream: its request as stored at create (what the worker reads)."""
    raw = r.hget(StreamKeys.of(uuid.UUID(sid), 1).meta, "req")
    assert isinstance(raw, bytes), sid
    return list(orjson.loads(raw)["messages"])


def turn(c: httpx.Client, conv: str, text: str, **fields: Any) -> httpx.Response:
    return c.post("/v1/streams", json={"conversation": conv, "messages": [{"role": "user", "content": text}],
                                       "max_tokens": 8, **fields})


def answer(c: httpx.Client, sid: str) -> str:
    read = read_sse(c, f"/v1/streams/{sid}/events")
    assert read.status == 200 and read.events[-1].event == "done", read.events[-1:]
    return str(read.text)


def test_each_turn_sends_only_what_is_new_and_the_engine_gets_the_whole_history(
        stack: Stack, redis_client: redis.Redis) -> None:
    conv = str(uuid.uuid4())
    texts: list[str] = []
    with stack.client() as c:
        for i in range(3):
            r = turn(c, conv, f"question {i}")
            assert r.status_code == 201 and r.json()["created"] and r.json()["conversation"] == conv, r.text
            sid = r.json()["id"]
            texts.append(answer(c, sid))
            expected: list[dict[str, Any]] = []
            for j in range(i):
                expected += [{"role": "user", "content": f"question {j}"}, {"role": "assistant", "content": texts[j]}]
            assert engine_messages(redis_client, sid) == [*expected, {"role": "user", "content": f"question {i}"}]
        # A second device reads the conversation back: every turn, its messages and its answer.
        history = c.get(f"/v1/conversations/{conv}/turns")
        assert history.status_code == 200
        body = history.json()
        assert body["id"] == conv
        assert [(t["messages"], t["output"]["text"], t["status"]) for t in body["turns"]] == [
            ([{"role": "user", "content": f"question {i}"}], texts[i], "done") for i in range(3)]
        # The same conversation in OpenAI's spelling, on the same route.
        assert c.get(f"/v1/conversations/conv_{uuid.UUID(conv).hex}/turns").json() == body
        assert c.get(f"/v1/conversations/{uuid.uuid4()}/turns").status_code == 404
        assert c.get("/v1/conversations/not-an-id/turns").status_code == 404


def test_the_worker_folds_a_turn_in_as_it_ends(stack: Stack, redis_client: redis.Redis) -> None:
    """No read is needed: the conversation holds the answer as soon as the stream has ended."""
    conv = str(uuid.uuid4())
    with stack.client() as c:
        sid = turn(c, conv, "hi").json()["id"]
        wait_status(c, sid, TERMINAL)
    k = ConversationKeys.of("", conv, 1)

    def kept() -> bool:
        assert redis_client.hget(k.meta, "turns") == b"1", redis_client.hgetall(k.meta)
        return True

    eventually(kept, 10)
    assert redis_client.hget(k.meta, "pending") == b""


def test_two_devices_sending_the_next_turn_at_once_make_one_turn_and_one_409(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The two requests race for the conversation's one pending turn. No generator runs while they race, so the
    winner's turn stays pending until the test cancels it: the loser meets it however late it arrives (a turn
    that ended first would let both through, which says nothing about rsb). Then a worker answers a last turn."""
    s = stack_factory(redis_server.url)
    s.consumer()
    conv = str(uuid.uuid4())
    with s.client() as c, ThreadPoolExecutor(2) as pool:
        for round_ in range(8):
            barrier = threading.Barrier(2)

            def send(device: str, round_: int = round_, barrier: threading.Barrier = barrier) -> httpx.Response:
                with s.client() as own:
                    barrier.wait()
                    return turn(own, conv, f"{device} says {round_}")

            results = list(pool.map(send, ["phone", "laptop"]))
            codes = sorted(r.status_code for r in results)
            assert codes == [201, 409], [r.text for r in results]
            loser = next(r for r in results if r.status_code == 409).json()["error"]
            winner = next(r for r in results if r.status_code == 201).json()
            assert loser["code"] == "conflict" and winner["id"] in loser["message"]
            assert c.post(f"/v1/streams/{winner['id']}/cancel").status_code == 202
            wait_status(c, winner["id"], TERMINAL)
        s.generator()
        last = turn(c, conv, "and now")
        assert last.status_code == 201, last.text
        wait_status(c, last.json()["id"], TERMINAL)
        turns = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
    assert [t["status"] for t in turns] == ["cancelled"] * 8 + ["done"]


def test_a_create_while_a_turn_runs_is_a_409_and_a_retry_of_the_running_turn_is_not(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator(model=slow_model)
    conv, sid = str(uuid.uuid4()), str(uuid.uuid4())
    with s.client() as c:
        first = turn(c, conv, "long one", id=sid, max_tokens=2000)
        assert first.status_code == 201
        other = turn(c, conv, "meanwhile")
        assert other.status_code == 409 and sid in other.json()["error"]["message"]
        retry = turn(c, conv, "long one", id=sid, max_tokens=2000)  # the same create again (a lost reply)
        assert retry.status_code == 200 and retry.json()["created"] is False
        with Client(s.base_url) as client, pytest.raises(ConflictError):  # the Python client says so too
            client.create(messages=[{"role": "user", "content": "meanwhile"}], conversation=conv)
        running = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
        assert [(t["id"], t["status"] in ("queued", "running"), t["output"]) for t in running] == [(sid, True, None)]
        assert running[0]["messages"] == [{"role": "user", "content": "long one"}]
        assert c.post(f"/v1/streams/{sid}/cancel").status_code == 202
        wait_status(c, sid, TERMINAL)
        after = turn(c, conv, "now")
        assert after.status_code == 201
        # The retry after the end is the same turn still: 200, no new generation.
        again = turn(c, conv, "long one", id=sid, max_tokens=2000)
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        changed = turn(c, conv, "something else", id=sid)
        assert changed.status_code == 409


def test_the_history_after_a_sigkill_mid_answer_holds_the_continued_answer_exactly_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    victim = s.generator("--lease-s", "1", model=slow_model)
    conv = str(uuid.uuid4())
    with s.client() as c:
        sid = turn(c, conv, "tell me a long story", max_tokens=1500).json()["id"]
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=60)
        assert [e for e in head.events if e.event == "delta"], "no delta before the kill"
        victim.kill()
        s.generator("--lease-s", "1", model=slow_model)
        wait_status(c, sid, TERMINAL, timeout_s=120)
        full = answer(c, sid)
        events = read_sse(c, f"/v1/streams/{sid}/events").events
        assert events[-1].data["usage"]["completion_tokens"] == 1500
        assert full.startswith(head.text) and len(full) > len(head.text)
        turns = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
        assert len(turns) == 1 and turns[0]["output"]["text"] == full
        nxt = turn(c, conv, "and then?").json()["id"]
        assert engine_messages(redis_client, nxt) == [
            {"role": "user", "content": "tell me a long story"}, {"role": "assistant", "content": full},
            {"role": "user", "content": "and then?"}]
    k = ConversationKeys.of("", conv, 1)
    records = [json.loads(t) for t in redis_client.lrange(k.turns, 0, -1)]
    assert [t["id"] for t in records] == [sid]


def test_a_turn_its_worker_did_not_fold_is_folded_by_the_next_read(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """A worker killed between its finish and its fold: the next read of the conversation folds the turn."""
    s = stack_factory(redis_server.url)
    s.consumer()
    conv = str(uuid.uuid4())
    with s.client() as c:
        sid = turn(c, conv, "hi").json()["id"]  # no generator: it stays queued
        assert c.post(f"/v1/streams/{sid}/cancel").status_code == 202  # the cancel folds it (no worker will)
        turns = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
        assert [(t["id"], t["status"]) for t in turns] == [(sid, "cancelled")]
        # Now the worker's case: a turn finished and left pending, as if its worker died before folding it.
        second = turn(c, conv, "again").json()["id"]
        k = ConversationKeys.of("", conv, 1)
        s.generator()
        wait_status(c, second, TERMINAL)
        # The worker folds just after the finish: undone only once it has (else the pop takes the first turn).
        eventually(lambda: redis_client.llen(k.turns) == 2, 10, "the worker folding the turn")
        redis_client.hset(k.meta, "pending", second)  # undo the worker's fold: remove its record, re-pend it
        redis_client.rpop(k.turns)
        redis_client.hincrby(k.meta, "turns", -1)
        turns = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
        assert [t["id"] for t in turns] == [sid, second] and turns[1]["output"]["text"] == answer(c, second)
        assert redis_client.hget(k.meta, "pending") == b""


def test_conversations_are_per_api_key(stack_factory: StackFactory, redis_server: RedisServer,
                                       redis_client: redis.Redis, tmp_path: Path) -> None:
    key_a, entry_a = new_key("alice")
    key_b, entry_b = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [entry_a, entry_b]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))
    s.generator()
    conv = str(uuid.uuid4())
    alice = httpx.Client(base_url=s.base_url, timeout=30, headers={"Authorization": f"Bearer {key_a}"})
    bob = httpx.Client(base_url=s.base_url, timeout=30, headers={"Authorization": f"Bearer {key_b}"})
    with alice, bob:
        sid = turn(alice, conv, "alice's secret").json()["id"]
        wait_status(alice, sid, TERMINAL)
        assert bob.get(f"/v1/conversations/{conv}/turns").status_code == 404
        assert httpx.get(f"{s.base_url}/v1/conversations/{conv}/turns").status_code == 401
        # The same id under another key is another conversation: nothing of alice's is in bob's prompt.
        theirs = turn(bob, conv, "bob here").json()["id"]
        assert engine_messages(redis_client, theirs) == [{"role": "user", "content": "bob here"}]
        assert len(alice.get(f"/v1/conversations/{conv}/turns").json()["turns"]) == 1


def test_a_conversation_past_its_bounds_is_refused_with_a_clear_error(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--conversation-max-turns", "2", "--max-prompt-chars", "400", "--max-conversations", "2")
    s.generator()
    conv = str(uuid.uuid4())
    with s.client() as c:
        for i in range(2):
            wait_status(c, turn(c, conv, f"q{i}").json()["id"], TERMINAL)
        full = turn(c, conv, "one more")
        assert full.status_code == 409 and full.json()["error"]["code"] == "conversation_full"
        assert "--conversation-max-turns" in full.json()["error"]["message"]
        long_conv = str(uuid.uuid4())
        wait_status(c, turn(c, long_conv, "x" * 300).json()["id"], TERMINAL)
        too_long = turn(c, long_conv, "y" * 300)
        assert too_long.status_code == 409 and "--max-prompt-chars" in too_long.json()["error"]["message"]
        # A third conversation for this caller (no API keys: its address) is one too many.
        third = turn(c, str(uuid.uuid4()), "hi")
        assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_conversations"
        for bad in ({"conversation": "nope"}, {"conversation": str(uuid.uuid4()), "prompt": "p"}):
            body = {"messages": [{"role": "user", "content": "x"}], **bad}
            if "prompt" in bad:
                body.pop("messages")
            r = c.post("/v1/streams", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
