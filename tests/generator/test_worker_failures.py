"""Generation that survives failures: real worker processes SIGKILLed, SIGSTOPped and SIGTERMed mid-answer.

Every scenario checks what a user would notice: the events a reader that stayed connected saw, those of a
reader that resumed across the failure and those of a reader that came afterwards are identical, gap-free
and duplicate-free, and the answer has exactly max_tokens tokens."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import cast

import jsonschema
import pytest
import redis
from helpers import SSE, SSERead, create, eventually, read_sse, wait_status
from servers import Stack, StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys, usage_log_key

pytestmark = pytest.mark.slow

MAX_TOKENS = 1500


def _key(e: SSE) -> tuple[str | None, str | None, object]:
    return (e.id, e.event, e.data)


def _assert_seamless(full: SSERead, max_tokens: int) -> None:
    types = [e.event for e in full.events]
    assert types[0] == "queued" and types.count("started") == 1 and types[-1] == "done", types[:5]
    assert set(types[types.index("started") + 1:-1]) == {"delta"}
    ids = full.ids
    assert len(ids) == len(set(ids)) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    usage = full.events[-1].data["usage"]
    assert usage["completion_tokens"] == max_tokens


def _three_readers(s: Stack, sid: str, failure: Callable[[], None]) -> tuple[SSERead, SSERead, SSERead]:
    """A reader connected throughout, one that leaves before the failure and resumes after it, and one that
    reads everything afterwards."""
    stayed: list[SSERead] = []
    with s.client() as c:
        t = threading.Thread(target=lambda: stayed.append(read_sse(s.client(), f"/v1/streams/{sid}/events")))
        t.start()
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=40)
        failure()
        tail = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": head.ids[-1]})
        t.join(120)
        resumed = SSERead(200, tail.headers, head.events + tail.events, [], [])
        after = read_sse(c, f"/v1/streams/{sid}/events")
    return stayed[0], resumed, after


def test_sigkilled_worker_is_taken_over_and_the_answer_continues_seamlessly(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    victim = s.generator("--lease-s", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=MAX_TOKENS).json()["id"]

    def crash() -> None:
        victim.signal(signal.SIGKILL)
        victim.wait(5)
        s.generator("--lease-s", "1", model=slow_model)  # the survivor takes the job over within the lease

    stayed, resumed, after = _three_readers(s, sid, crash)
    _assert_seamless(after, MAX_TOKENS)
    assert [_key(e) for e in stayed.events] == [_key(e) for e in after.events]
    assert [_key(e) for e in resumed.events] == [_key(e) for e in after.events]
    assert redis_client.hget(f"rsb:{{p0}}:s:{sid}:meta", "attempts") == b"2"
    # One usage record: the tokens the stream holds, and the lost attempt's prefill of the prompt as wasted.
    entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", redis_client.xrange(usage_log_key(0, 1, "")))
    records = [f for _, f in entries if f[b"sid"] == sid.encode()]
    assert len(records) == 1, records
    [record] = records
    usage = after.events[-1].data["usage"]
    assert int(record[b"completion_tokens"]) == MAX_TOKENS and record[b"status"] == b"done"
    assert int(record[b"prompt_tokens"]) == usage["prompt_tokens"]
    print("crash-continued record:", record)
    assert 0 < int(record[b"wasted_tokens"]) < usage["prompt_tokens"]


def test_a_zombie_worker_that_wakes_up_appends_nothing(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    zombie = s.generator("--lease-s", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=MAX_TOKENS).json()["id"]
        read_sse(c, f"/v1/streams/{sid}/events", stop_after=30)
        zombie.signal(signal.SIGSTOP)  # frozen mid-answer: its lease lapses
        s.generator("--lease-s", "1", model=slow_model)
        eventually(lambda: redis_client.hget(f"rsb:{{p0}}:s:{sid}:meta", "attempts") == b"2", 30, "the takeover")
        zombie.signal(signal.SIGCONT)  # wakes up believing it still owns the stream
        wait_status(c, sid, {"done"})
        full = read_sse(c, f"/v1/streams/{sid}/events")
    _assert_seamless(full, MAX_TOKENS)
    eventually(lambda: "lost the lease" in zombie.output(), 10, "the zombie logging that it lost the lease")
    assert redis_client.xlen(f"rsb:{{p0}}:s:{sid}:events") == len(full.events)


def test_sigterm_past_the_grace_period_hands_the_job_over_at_once(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    leaving = s.generator("--lease-s", "30", "--generator-grace-s", "0.2", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=MAX_TOKENS).json()["id"]

    term_at: list[float] = []
    ready_at: list[float] = []

    def term() -> None:
        term_at.append(time.time())
        leaving.signal(signal.SIGTERM)
        assert leaving.wait(10) == 0
        # A 30 s lease would delay a crash takeover; a handed-over job is taken at once.
        s.generator("--lease-s", "30", model=slow_model)
        ready_at.append(time.time())

    stayed, resumed, after = _three_readers(s, sid, term)
    # Claimed by the new worker as soon as it polled (the last claim's time, Unix s, Redis's clock), not once the
    # leaving worker's lease lapsed: well under 30 s however slow this machine was to start that worker.
    claimed_at = float(redis_client.hget(StreamKeys.of(uuid.UUID(sid), 1).meta, "claimed_at") or 0)
    assert term_at[0] < claimed_at < ready_at[0] + 10, (claimed_at - term_at[0], claimed_at - ready_at[0])
    _assert_seamless(after, MAX_TOKENS)
    assert [_key(e) for e in stayed.events] == [_key(e) for e in after.events] == [_key(e) for e in resumed.events]
    assert "handed the job over" in leaving.output()


def test_sigterm_within_the_grace_period_finishes_the_job_in_flight(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    gen = s.generator("--generator-grace-s", "30")
    with s.client() as c:
        sid = create(c, max_tokens=3000).json()["id"]
        read_sse(c, f"/v1/streams/{sid}/events", stop_after=5)
        gen.signal(signal.SIGTERM)
        assert gen.wait(30) == 0
        st = c.get(f"/v1/streams/{sid}").json()
        assert st["status"] == "done" and st["usage"]["completion_tokens"] == 3000
        # It stopped claiming: a new stream waits for another worker.
        sid2 = create(c, max_tokens=4).json()["id"]
        assert c.get(f"/v1/streams/{sid2}").json()["status"] == "queued"


def test_attempts_exhausted_end_the_stream_with_worker_lost(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    victim = s.generator("--lease-s", "1", "--max-attempts", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=MAX_TOKENS).json()["id"]
        read_sse(c, f"/v1/streams/{sid}/events", stop_after=10)
        victim.signal(signal.SIGKILL)
        victim.wait(5)
        s.generator("--lease-s", "1", "--max-attempts", "1", model=slow_model)
        wait_status(c, sid, {"error"})
        events = read_sse(c, f"/v1/streams/{sid}/events").events
    assert events[-1].event == "error" and events[-1].data["code"] == "worker_lost"
    assert 0 < events[-1].data["usage"]["completion_tokens"] < MAX_TOKENS


def test_deadline_ends_the_generation_with_error_deadline(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--max-generation-s", "0.5", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=MAX_TOKENS).json()["id"]
        events = read_sse(c, f"/v1/streams/{sid}/events").events
        assert events[-1].event == "error" and events[-1].data["code"] == "deadline"
        assert 0 < events[-1].data["usage"]["completion_tokens"] < MAX_TOKENS
        # The worker is free again straight away.
        sid2 = create(c, max_tokens=5).json()["id"]
        assert read_sse(c, f"/v1/streams/{sid2}/events").events[-1].event == "done"


@pytest.mark.slow
def test_a_lease_renewal_that_fails_for_a_bug_ends_the_stream_with_an_error(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    """RENEW fails on a stream whose meta holds a value it cannot read (a failing script, not Redis away): the
    renewer does not go on renewing nothing in silence; the generation stops, and its stream ends with ``error``
    (code ``internal``) that readers see, and the generator logs why."""

    s = stack_factory(redis_server.url)
    s.consumer()
    gen = s.generator("--lease-s", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, max_tokens=MAX_TOKENS).json()["id"]
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=3)
        assert head.events[-1].event == "delta"
        # Python reads "1_0" as 10 (the status route works); Lua's tonumber does not: RENEW fails, and only RENEW.
        redis_client.hset(StreamKeys.of(uuid.UUID(sid), 1).meta, "abandon_s", "1_0")
        read = read_sse(c, f"/v1/streams/{sid}/events", timeout_s=30)
        st = wait_status(c, sid, {"done", "cancelled", "error"})
    end = read.events[-1]
    assert end.event == "error" and end.data["code"] == "internal", end
    assert st["status"] == "error"
    assert end.data["usage"]["completion_tokens"] < MAX_TOKENS
    assert "keeping the lease failed" in gen.output()


# -- a crash inside a tool call's arguments (constrained decoding, continued) ---------------------------------

NOTES_TOOL = {"type": "function", "function": {"name": "save_notes", "parameters": {
    "type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 12,
                                                                          "maxLength": 24},
                                               "minItems": 30, "maxItems": 30}},
    "required": ["notes"], "additionalProperties": False}}}


@pytest.mark.slow
def test_sigkilled_inside_a_tool_call_the_continuation_completes_valid_arguments_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    victim = s.generator("--lease-s", "1", model=slow_model)
    with s.client() as c:
        sid = create(c, messages=[{"role": "user", "content": "Take notes"}], tools=[NOTES_TOOL],
                     tool_choice="required", max_tokens=3000, temperature=1.0, seed=7).json()["id"]
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=12)
        assert head.events[-1].event == "tool_args", [e.event for e in head.events]
        victim.signal(signal.SIGKILL)
        victim.wait(5)
        s.generator("--lease-s", "1", model=slow_model)
        full = read_sse(c, f"/v1/streams/{sid}/events")
    assert redis_client.hget(f"rsb:{{p0}}:s:{sid}:meta", "attempts") == b"2"
    types = [e.event for e in full.events if e.event != "progress"]  # the continuation's prompt is long
    assert types.count("started") == 1 and types.count("tool_call") == 1 and types[-1] == "done", types
    assert set(types[types.index("tool_call") + 1:-1]) == {"tool_args"}
    ids = full.ids
    assert len(ids) == len(set(ids)) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    args = "".join(e.data["text"] for e in full.events if e.event == "tool_args")
    head_args = "".join(e.data["text"] for e in head.events if e.event == "tool_args")
    assert args.startswith(head_args) and len(args) > len(head_args)  # went on from where it stopped
    jsonschema.validate(json.loads(args), NOTES_TOOL["function"]["parameters"])  # type: ignore[index]
    assert full.events[-1].data["finish_reason"] == "tool_calls"
