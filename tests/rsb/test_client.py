"""The Python client (rsb.Client, rsb.AsyncClient) and the client commands (rsb chat / tail / status) against a real stack:
redis-server, `rsb generator` (llama.cpp on the demo models) and `rsb consumer` processes. Disconnects are
real: the consumer process is SIGKILLed mid-stream."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from helpers import eventually, read_sse, wait_status
from servers import SharedStack, StackFactory

from broker.redis.server import RedisServer, free_port
from rsb import (
    AsyncClient,
    AuthenticationError,
    Client,
    ConflictError,
    Event,
    ExpiredError,
    InvalidRequestError,
    NotFoundError,
    RetryPolicy,
    StreamInterrupted,
    UnavailableError,
)
from rsb._terminal import TerminalText

ROOT = Path(__file__).resolve().parent.parent.parent
# Quick retries, so the tests do not wait out production backoffs; the cap is what is tested.
FAST = RetryPolicy(max_retries=40, base_delay_s=0.05, max_delay_s=0.5)


def _assert_one_clean_stream(events: list[Event], max_tokens: int) -> None:
    types = [e.type for e in events]
    assert types[0] == "queued" and types.count("started") == 1 and types[-1] == "done", types[:5]
    assert set(types[types.index("started") + 1:-1]) == {"delta"}
    ids = [e.id for e in events]
    assert len(ids) == len(set(ids))
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert events[-1].data["usage"]["completion_tokens"] == max_tokens


def test_stream_yields_the_whole_answer(shared_stack: SharedStack) -> None:
    with Client(shared_stack.base_url) as rsb:
        info = rsb.create(prompt="Hello", max_tokens=40)
        assert info.created and info.status == "queued" and uuid.UUID(info.id)
        events = list(rsb.stream(info.id))
        _assert_one_clean_stream(events, 40)
        with shared_stack.client() as c:
            raw = read_sse(c, f"/v1/streams/{info.id}/events")
        assert [(e.id, e.type, e.data) for e in events] == [(e.id, e.event, e.data) for e in raw.events]
        assert "".join(e.text for e in events) == raw.text

        # Idempotent by id: the same request answers the same stream; a different one is a conflict.
        again = rsb.create(prompt="Hello", max_tokens=40, id=info.id)
        assert (again.id, again.created) == (info.id, False)
        with pytest.raises(ConflictError) as conflict:
            rsb.create(prompt="Bye", max_tokens=40, id=info.id)
        assert conflict.value.status_code == 409 and conflict.value.code == "conflict"

        st = rsb.status(info.id)
        assert st.finished and st.status == "done" and st.usage is not None
        assert st.usage["completion_tokens"] == 40
        assert rsb.cancel(info.id).status == "done"  # a finished stream stays as it is

        # Resuming after the terminal event: the server answers 204 and nothing follows.
        assert list(rsb.stream(info.id, last_event_id=events[-1].id)) == []
        # Resuming after a delta: exactly the rest.
        mid = len(events) // 2
        assert list(rsb.stream(info.id, last_event_id=events[mid].id)) == events[mid + 1:]

        with pytest.raises(NotFoundError):
            rsb.status(str(uuid.uuid4()))
        with pytest.raises(NotFoundError):
            list(rsb.stream(str(uuid.uuid4())))
        with pytest.raises(InvalidRequestError):
            list(rsb.stream(info.id, last_event_id="not-an-id"))
        with pytest.raises(ValueError):
            rsb.create(prompt="x", messages=[{"role": "user", "content": "x"}])


def test_cancel_ends_the_stream_with_cancelled(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator(model=slow_model)
    with Client(s.base_url) as rsb:
        info = rsb.create(prompt="Hello", max_tokens=3000)
        seen: list[Event] = []
        for event in rsb.stream(info.id):
            seen.append(event)
            if len(seen) == 20:
                assert rsb.cancel(info.id).status in ("queued", "running")
        assert seen[-1].type == "cancelled" and seen[-1].data["reason"] == "client"
        assert rsb.status(info.id).status == "cancelled"


async def test_the_async_client_does_the_same(shared_stack: SharedStack) -> None:
    async with AsyncClient(shared_stack.base_url) as rsb:
        info = await rsb.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=30)
        events = [e async for e in rsb.stream(info.id)]
        _assert_one_clean_stream(events, 30)
        text, end = await rsb.text(info.id)
        assert text == "".join(e.text for e in events) and end == events[-1]
        assert (await rsb.status(info.id)).status == "done"
        assert [e async for e in rsb.stream(info.id, last_event_id=events[3].id)] == events[4:]
        with pytest.raises(NotFoundError):
            await rsb.status(str(uuid.uuid4()))


def test_a_consumer_killed_mid_stream_is_resumed_without_gap_or_duplicate(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    port = free_port()
    victim, url = s.consumer(port=port)
    _, witness_url = s.consumer()
    s.generator(model=slow_model)
    with Client(url, retry=FAST) as rsb, Client(witness_url) as witness:
        info = rsb.create(prompt="Hello", max_tokens=1500)
        events: list[Event] = []
        for event in rsb.stream(info.id):
            events.append(event)
            if len(events) == 30:
                # The connection dies with the process; a new consumer comes up on the same address.
                victim.signal(signal.SIGKILL)
                victim.wait(5)
                killed_while = witness.status(info.id).status
                s.consumer(port=port)
    assert killed_while == "running"  # so the client resumed a live tail, not just a replay
    _assert_one_clean_stream(events, 1500)
    with s.client(url) as c:
        after = read_sse(c, f"/v1/streams/{info.id}/events")
    assert [(e.id, e.type, e.data) for e in events] == [(e.id, e.event, e.data) for e in after.events]


def test_backoff_gives_up_with_a_typed_error_when_the_server_is_gone(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    victim, url = s.consumer()
    s.generator(model=slow_model)
    policy = RetryPolicy(max_retries=3, base_delay_s=0.05, max_delay_s=0.2)
    with Client(url, retry=policy) as rsb:
        info = rsb.create(prompt="Hello", max_tokens=3000)
        events: list[Event] = []
        t0 = 0.0
        with pytest.raises(StreamInterrupted) as gone:
            for event in rsb.stream(info.id):
                events.append(event)
                if len(events) == 10:
                    victim.signal(signal.SIGKILL)  # and nothing comes back
                    t0 = time.monotonic()
        assert time.monotonic() - t0 < 5.0  # 3 retries of at most 0.2 s each
        assert gone.value.attempts == 4 and gone.value.last_event_id == events[-1].id
        assert isinstance(gone.value, UnavailableError) and gone.value.status_code is None
        # Plain calls give up the same way.
        with pytest.raises(UnavailableError):
            rsb.status(info.id)
    # Where to pick up from, once a server is back: the rest, and nothing twice.
    _, url2 = s.consumer()
    with Client(url2) as rsb:
        rsb.cancel(info.id)
        rest = list(rsb.stream(info.id, last_event_id=gone.value.last_event_id))
    assert rest[-1].terminal
    with s.client(url2) as c:
        full = read_sse(c, f"/v1/streams/{info.id}/events")
    assert [(e.id, e.type, e.data) for e in events + rest] == [(e.id, e.event, e.data) for e in full.events]


def test_expired_streams_raise_expired(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    _, url = s.consumer("--retention-s", "1")
    s.generator()
    with Client(url) as rsb:
        info = rsb.create(prompt="Hello", max_tokens=4)
        assert list(rsb.stream(info.id))[-1].type == "done"

        def expired() -> ExpiredError | None:
            try:
                rsb.status(info.id)
            except ExpiredError as e:
                return e
            return None

        gone = eventually(expired, 10, "the stream expiring (retention 1 s)", interval_s=0.2)
        assert gone.status_code == 410 and gone.code == "expired"
        with pytest.raises(ExpiredError):
            list(rsb.stream(info.id))


def test_the_api_key_is_sent_as_a_bearer_token(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    secret = "s3cret"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "alice", "sha256": hashlib.sha256(secret.encode()).hexdigest()}]}))
    s = stack_factory(redis_server.url)
    _, url = s.consumer("--api-keys", str(keys))
    s.generator()
    with Client(url) as anonymous, pytest.raises(AuthenticationError):
        anonymous.create(prompt="Hello", max_tokens=4)
    with Client(url, api_key=f"alice.{secret}") as rsb:
        info = rsb.create(prompt="Hello", max_tokens=4)
        assert list(rsb.stream(info.id))[-1].type == "done"


# -- the rsb chat / tail / status commands -------------------------------------------------------


def shown(answer: str) -> str:
    """What the commands print of an answer: the random-weight models' text holds control characters, which
    never reach the terminal (rsb._terminal)."""
    return TerminalText().feed(answer)


def _rsb(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[bytes]:
    full_env = dict(os.environ, PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run([sys.executable, "-m", "rsb", *args], cwd=ROOT, env=full_env,
                          capture_output=True, timeout=timeout_s)


def test_rsb_chat_tail_and_status_print_the_answer(shared_stack: SharedStack) -> None:
    chat = _rsb("chat", "Tell me a story", "--url", shared_stack.base_url, "--max-tokens", "25")
    assert chat.returncode == 0, chat.stderr.decode()
    err = chat.stderr.decode()
    sid = err.split("rsb: stream ", 1)[1].split()[0]
    assert f"rsb tail {sid}" in err
    with Client(shared_stack.base_url) as rsb:
        answer, end = rsb.text(sid)
    assert end is not None and end.type == "done" and end.data["usage"]["completion_tokens"] == 25
    assert chat.stdout.decode() == shown(answer) + "\n"

    tail = _rsb("tail", sid, env={"RSB_URL": shared_stack.base_url})  # the flag's environment twin
    assert tail.returncode == 0, tail.stderr.decode()
    assert tail.stdout.decode() == shown(answer) + "\n"

    events = [json.loads(line) for line in _rsb("tail", sid, "--url", shared_stack.base_url, "--json").stdout.splitlines()]
    assert [e["type"] for e in events][-1] == "done"
    at = [i for i, e in enumerate(events) if e["type"] == "delta"]
    assert at and at[0] > 0 and "".join(events[i]["data"]["text"] for i in at) == answer
    # From the event before the later half of the deltas: mid-answer whenever the answer came in two or more
    # deltas. A busy loop may coalesce all 25 tokens into one; then it resumes from just before the answer.
    cut = at[len(at) // 2] - 1
    rest = _rsb("tail", sid, "--url", shared_stack.base_url, "--from", events[cut]["id"])
    assert rest.stdout.decode() == shown("".join(e["data"]["text"] for e in events[cut + 1:] if e["type"] == "delta")) + "\n"

    status = _rsb("status", sid, "--url", shared_stack.base_url)
    assert status.returncode == 0
    body = json.loads(status.stdout)
    assert body["id"] == sid and body["status"] == "done" and body["usage"]["completion_tokens"] == 25

    missing = _rsb("status", str(uuid.uuid4()), "--url", shared_stack.base_url)
    assert missing.returncode == 2 and b"no stream" in missing.stderr


def test_rsb_chat_with_an_id_replays_instead_of_generating_twice(shared_stack: SharedStack) -> None:
    sid = str(uuid.uuid4())
    first = _rsb("chat", "Hi", "--url", shared_stack.base_url, "--max-tokens", "10", "--id", sid)
    second = _rsb("chat", "Hi", "--url", shared_stack.base_url, "--max-tokens", "10", "--id", sid)
    assert first.returncode == second.returncode == 0
    assert first.stdout == second.stdout
    with shared_stack.client() as c:
        assert wait_status(c, sid, {"done"})["usage"]["completion_tokens"] == 10


def test_rsb_tail_follows_a_running_stream_and_rsb_chat_reports_an_unreachable_server(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    _, url = s.consumer()
    s.generator(model=slow_model)
    with Client(url) as rsb:
        info = rsb.create(prompt="Hello", max_tokens=1500)
        tail = subprocess.Popen([sys.executable, "-m", "rsb", "tail", info.id, "--url", url], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(os.environ, PYTHONIOENCODING="utf-8"))
        out, err = tail.communicate(timeout=60)
        answer, end = rsb.text(info.id)
    assert tail.returncode == 0, err.decode()
    assert end is not None and end.type == "done"
    assert out.decode() == shown(answer) + "\n"

    dead = f"http://127.0.0.1:{free_port()}"
    gone = _rsb("chat", "Hello", "--url", dead, "--max-retries", "1")
    assert gone.returncode == 3 and b"rsb chat:" in gone.stderr


def test_a_reset_takes_back_the_text_after_the_id_it_names() -> None:
    """What ``text()`` does with a ``reset`` (a failover lost events the reader had: docs/failures.md)."""
    from rsb._types import Answer, Event

    answer = Answer()
    for ev in [Event("1-0", "started", {}), Event("2-0", "delta", {"text": "ab"}), Event("3-0", "delta", {"text": "c"}),
               Event("4-0", "delta", {"text": "d"}), Event("2-0", "reset", {"last_event_id": "2-0"}),
               Event("5-0", "delta", {"text": "C"})]:
        answer.feed(ev)
    assert answer.text == "abC"
    answer.feed(Event("0-0", "reset", {"last_event_id": None}))
    assert answer.text == ""


def test_the_create_body_carries_openai_sampling_fields() -> None:
    from rsb._client import build_create_body

    body = build_create_body(messages=[{"role": "user", "content": "x"}], prompt=None, id=None, model=None,
                             max_tokens=None, temperature=None, top_p=None, seed=None, stop=None,
                             cancel_on_disconnect=None, presence_penalty=0.5, logit_bias={"7": -100},
                             parallel_tool_calls=False)
    assert (body["presence_penalty"], body["logit_bias"], body["parallel_tool_calls"]) == (0.5, {"7": -100}, False)
    with pytest.raises(TypeError, match="bogus"):
        build_create_body(messages=None, prompt="x", id=None, model=None, max_tokens=None, temperature=None,
                          top_p=None, seed=None, stop=None, cancel_on_disconnect=None, bogus=1)
