"""Chat-affine claiming, with two real generator workers on a real redis-server: a chat's next turn goes to
the worker that ran its last one (whose prompt cache holds the history: ``cached_tokens`` > 0), and a turn
whose worker died runs elsewhere once the bounded wait is over."""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import pytest
import redis
from helpers import create, read_sse
from servers import StackFactory

from bench.procs import Proc
from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow

WORDS = "river stone cloud lamp orchard silver quiet engine harbor window meadow copper lantern".split()


def user_text(chat: int, turn: int) -> str:
    return " ".join(WORDS[(chat * 7 + turn * 3 + i) % len(WORDS)] for i in range(120))


def worker_of(workers: list[Proc], sid: str) -> int:
    """Which of ``workers`` claimed the stream (its log says so)."""
    ran = [i for i, w in enumerate(workers) if f'"msg":"claimed","stream_id":"{sid}"' in w.output()]
    assert len(ran) == 1, ran
    return ran[0]


def turn(c: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> tuple[str, dict[str, Any], str]:
    res = create(c, messages=messages, max_tokens=8, seed=1, **extra)
    assert res.status_code == 201, res.text
    read = read_sse(c, res.json()["events_url"])
    last = read.events[-1]
    assert last.event == "done", last
    text = "".join(e.data["text"] for e in read.events if e.event == "delta")
    return res.json()["id"], last.data["usage"], text


def test_follow_up_turns_go_to_the_worker_holding_the_chat(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    procs = [s.generator("--affinity-wait-s", "5"), s.generator("--affinity-wait-s", "5")]
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": f"chat {i}"}] for i in range(3)]
    workers: list[set[int]] = [set() for _ in chats]
    with s.client() as c:
        for t in range(3):
            for i, msgs in enumerate(chats):
                msgs.append({"role": "user", "content": user_text(i, t)})
                # Chat 2 names itself with OpenAI's prompt_cache_key; the others by their leading messages. An
                # odd number of chats: idle workers take jobs in turn, which alone would move every chat.
                extra = {"prompt_cache_key": "chat-2"} if i == 2 else {}
                sid, usage, text = turn(c, msgs, **extra)
                workers[i].add(worker_of(procs, sid))
                if t > 0:
                    assert usage["cached_tokens"] > 0, (i, t, usage)
                msgs.append({"role": "assistant", "content": text})
    assert all(len(w) == 1 for w in workers), workers
    assert len(set().union(*workers)) == 2  # and both workers had chats


def test_a_turn_whose_worker_died_runs_elsewhere_after_the_wait(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    first = s.generator("--affinity-wait-s", "2", "--lease-s", "4")
    msgs = [{"role": "user", "content": user_text(0, 0)}]
    with s.client() as c:
        sid, _, text = turn(c, msgs)
        second = s.generator("--affinity-wait-s", "2", "--lease-s", "4")
        first.signal(signal.SIGKILL)
        first.wait(5)
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": user_text(0, 1)}]
        t0 = time.monotonic()
        sid2, usage, _ = turn(c, msgs)
        waited_s = time.monotonic() - t0
    assert worker_of([first, second], sid) == 0 and worker_of([first, second], sid2) == 1
    assert usage["cached_tokens"] == 0  # a new worker: nothing cached
    assert 1.5 < waited_s < 2 + 3  # it waited for the dead owner, within the bound (plus the generation)
    assert second.alive()


def test_prompt_cache_key_is_validated(stack_factory: StackFactory, redis_server: RedisServer,
                                       redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        for bad in ("", 7, "x" * 257):
            res = create(c, prompt_cache_key=bad)
            assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_request", res.text
            assert "prompt_cache_key" in res.json()["error"]["message"]
