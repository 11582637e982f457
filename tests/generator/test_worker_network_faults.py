"""Generators whose network to Redis fails while their process lives, through the tests' fault proxy
(tests/faultproxy.py) between each and a real redis-server; the engine is a paced scripted upstream (100 words a
second, `` w0 w1 ...``, whatever the machine's load), so each attempt's words are numbered from w0 and a duplicate
or a lost seam shows in the text.

- Cut off past its lease mid-answer: another worker takes the stream over; when the link heals, nothing the old one
  sends lands (its appends are fenced out): the answer holds two runs of words, one per attempt, and every reader's
  history is the stream's.
- Idle when its links go half-open: it claims again once they are replaced (only the open links died) or healed
  (a partition), within the bound of its blocking wait and a command's timeout.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from faultproxy import FaultProxy
from helpers import create, eventually, stored_events, stored_text, wait_status
from history import HistoryReader, check_history
from scripted_upstream import ScriptedUpstream, paced
from servers import StackFactory

from broker.events import Event
from broker.redis.connection import BLOCKING_TIMEOUT_S, COMMAND_TIMEOUT_S
from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys

pytestmark = pytest.mark.slow

LEASE_S = 2.0
# An idle generator whose links died claims within its blocked BLPOP's timeout and a claim's (a loaded machine adds).
CLAIM_BOUND_S = BLOCKING_TIMEOUT_S + COMMAND_TIMEOUT_S + 8


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        up.respond = paced(100)
        yield up


def _upstream_args(upstream: ScriptedUpstream) -> tuple[str, ...]:
    return ("--upstream", upstream.url, "--lease-s", str(LEASE_S))


def _final(redis_client: redis.Redis, sid: str, timeout_s: float = 120) -> list[Event]:
    def ended() -> list[Event] | None:
        events = stored_events(redis_client, sid)
        return events if events and events[-1].is_terminal else None

    final: list[Event] = eventually(ended, timeout_s, f"stream {sid} to end")
    return final


def test_a_generator_cut_off_past_its_lease_is_taken_over_and_nothing_it_sends_lands(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        upstream: ScriptedUpstream) -> None:
    proxy = FaultProxy(redis_server.port)
    try:
        direct = stack_factory(redis_server.url)
        _, url = direct.consumer("--heartbeat-s", "1")
        old = stack_factory(proxy.url).generator(*_upstream_args(upstream), ignore_eos=False)
        with httpx.Client(base_url=url, timeout=30) as c:
            sid = create(c, max_tokens=1500).json()["id"]
        meta = StreamKeys.of(uuid.UUID(sid), 1).meta
        readers = [HistoryReader([url], sid, timeout_s=120).start() for _ in range(2)]
        eventually(lambda: len(stored_text(redis_client, sid).split()) >= 100, 30, "the old worker under way")
        direct.generator(*_upstream_args(upstream), ignore_eos=False)  # idle until the lease lapses
        proxy.dark()  # the old worker's process runs on; its network does not
        t_cut = time.monotonic()
        eventually(lambda: redis_client.hget(meta, "fence") == b"2", 30, "another worker to take the stream over")
        took_over = time.monotonic() - t_cut
        at_takeover = len(stored_text(redis_client, sid).split())
        eventually(lambda: len(stored_text(redis_client, sid).split()) >= at_takeover + 200, 30,
                   "the new owner under way")
        proxy.heal()  # what the old worker sent meanwhile, and sends now, reaches Redis
        eventually(lambda: "lost the lease" in old.output(), 30, "the old worker fenced out once its link healed")
        final = _final(redis_client, sid)
        for reader in readers:
            reader.join()
            check_history(reader, final)
        text = "".join(e.json()["text"] for e in final if e.type == "delta")
        words = text.split()
        # One run of numbered words per attempt (each attempt's request starts at w0): nothing the old owner sent
        # after the takeover landed, nothing was lost at the seam, and the budget was kept exactly.
        seams = [i for i, w in enumerate(words) if w == "w0"]
        assert len(seams) == 2 and seams[0] == 0 and words[seams[1] - 1] == f"w{seams[1] - 1}", seams
        assert all(re.fullmatch(r"w\d+", w) for w in words) and len(words) == 1500
        assert final[-1].json()["usage"]["completion_tokens"] == 1500
        print(f"\ncut past the lease ({LEASE_S:g} s): taken over after {took_over:.1f}s; the old worker's sends "
              f"refused once its link healed")
    finally:
        proxy.close()


def test_an_idle_generator_whose_links_died_claims_again(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        upstream: ScriptedUpstream) -> None:
    proxy = FaultProxy(redis_server.port)
    try:
        _, url = stack_factory(redis_server.url).consumer()
        stack_factory(proxy.url).generator(*_upstream_args(upstream), ignore_eos=False)
        with httpx.Client(base_url=url, timeout=30) as c:
            sid = create(c, max_tokens=5).json()["id"]
            wait_status(c, sid, {"done"}, 30)
            took = []
            # Replaced: the links open now die (no FIN, no RST); new ones work. Then healed: a partition that ends.
            for fault in ("replaced", "healed"):
                proxy.dark(new_too=fault == "healed")
                time.sleep(1.0)  # the worker is blocked in its wait on a link that is dead now
                sid = create(c, max_tokens=5).json()["id"]
                t0 = time.monotonic()
                if fault == "healed":
                    time.sleep(10.0)  # a partition that lasts
                    assert c.get(f"/v1/streams/{sid}").json()["status"] == "queued"
                    proxy.heal()
                    t0 = time.monotonic()
                wait_status(c, sid, {"done"}, CLAIM_BOUND_S)  # claimed again ({fault})
                took.append(time.monotonic() - t0)
        print(f"\nan idle generator's dead links: claimed again {took[0]:.1f}s after the job came (links replaced), "
              f"{took[1]:.1f}s after the partition healed")
    finally:
        proxy.close()
