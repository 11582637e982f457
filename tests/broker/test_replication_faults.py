"""Durability ``replicated`` when the network splits a primary from its replica but not from its clients: the classic
way Redis loses acknowledged writes (the primary goes on taking them, the replica is promoted without them). Real
redis-servers, the replica replicating through the tests' fault proxy (tests/faultproxy.py), a consumer and a
generator each reaching "the primary" through a proxy of its own (a service address a failover moves).

The primary takes appends while cut off from its replica, but WAIT says no replica has them, so no reader is shown
one. The replica is promoted (and the old primary killed, with what only it had); the service addresses move to it;
a new replica joins. Every reader's history is the final stream's, exactly: no event a reader saw was lost, no
``reset`` (tests/history.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import redis
from faultproxy import FaultProxy
from helpers import create, eventually, stored_events
from history import HistoryReader, check_history
from scripted_upstream import ScriptedUpstream, paced
from servers import StackFactory

from broker.events import Event
from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for s in started:
        s.cleanup()


def test_a_primary_cut_off_from_its_replica_loses_nothing_a_reader_saw(
        stack_factory: StackFactory, servers: list[RedisServer]) -> None:
    primary = RedisServer(extra_args=("--repl-diskless-sync-delay", "0")).start()
    servers.append(primary)
    link = FaultProxy(primary.port)  # the replica's link to the primary
    service = [FaultProxy(primary.port) for _ in range(2)]  # "the primary", for the consumer and the generator
    proxies = [link, *service]
    try:
        replica = RedisServer(extra_args=("--replicaof", "127.0.0.1", str(link.port))).start()
        servers.append(replica)
        replica_client = redis.Redis(port=replica.port)
        eventually(lambda: replica_client.info("replication").get("master_link_status") == "up", 20)
        with ScriptedUpstream() as up:
            up.respond = paced(100)
            durable = ("--durability", "replicated", "--replica-wait-ms", "200")
            _, url = stack_factory(service[0].url).consumer("--heartbeat-s", "1", *durable)
            stack_factory(service[1].url).generator("--upstream", up.url, "--lease-s", "2", *durable,
                                                    ignore_eos=False)
            with httpx.Client(base_url=url, timeout=30) as c:
                sid = create(c, max_tokens=1200).json()["id"]
            readers = [HistoryReader([url], sid, timeout_s=150).start() for _ in range(2)]
            eventually(lambda: sum(1 for e in readers[0].events if e.event == "delta") >= 20, 30,
                       "readers under way")

            link.dark()  # the replica is cut off; the clients still reach the primary
            primary_client = redis.Redis(port=primary.port)

            def ahead() -> bool:  # the primary holds events no replica has (its worker waits for WAIT, then parks)
                return len(stored_events(primary_client, sid)) > len(stored_events(replica_client, sid))

            eventually(ahead, 30, "the primary to take appends its replica never gets")
            seen = {e.id for r in readers for e in r.events}
            replica_ids = {e.id for e in stored_events(replica_client, sid)}
            assert seen <= replica_ids, "a reader was shown an event only the cut-off primary had"

            only_primary = len(stored_events(primary_client, sid)) - len(replica_ids)
            # The failover: the replica promoted, the old primary gone with what only it had, the service
            # addresses moved to the new primary, and a new replica for it (replicated needs one to go on).
            replica_client.execute_command("REPLICAOF", "NO", "ONE")
            primary.stop()
            for p in service:
                p.retarget(replica.port)
            servers.append(RedisServer(extra_args=("--replicaof", "127.0.0.1", str(replica.port))).start())

            def ended() -> list[Event] | None:
                events = stored_events(replica_client, sid)
                return events if events and events[-1].is_terminal else None

            final: list[Event] = eventually(ended, 90, "the stream to end on the new primary")
            for r in readers:
                r.join()
                check_history(r, final)
            print(f"\nreplica cut off: the primary took {only_primary} events no replica had, none shown to a reader; "
                  f"after the failover every reader's history is the stream's ({len(final)} events)")
    finally:
        for p in proxies:
            p.close()
