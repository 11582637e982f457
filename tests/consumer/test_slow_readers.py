"""Many readers and slow readers on one real `rsb consumer`: 2,000 live readers share a handful of Redis
connections, and a reader that stops reading neither grows the pod's memory nor slows the other readers of its
stream; past --send-timeout-s it is dropped, and it resumes from its last event id.

The readers here are raw sockets (an asyncio client per reader would cost more than the pod under test); the
events are appended with broker.streams.job_store directly, so their number and size are exact."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import time
import uuid

import httpx
import psutil
import pytest
import redis
from helpers import eventually_async
from servers import StackFactory

from broker.events import EventType, encode_data
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore

pytestmark = pytest.mark.slow

REQ = GenerationRequest(None, "x", None, 100000, 0.8, 0.95, None, (), False)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


class RawReader:
    """One SSE reader on a plain socket. ``rcvbuf`` shrinks the kernel's receive buffer (set before connecting,
    as the window is negotiated then), so a reader that stops reading makes the server's writes stall soon."""

    def __init__(self, port: int, sid: str, *, last_event_id: str | None = None, rcvbuf: int | None = None) -> None:
        self.port, self.sid, self.last_event_id, self.rcvbuf = port, sid, last_event_id, rcvbuf
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.buf = b""
        self.events: list[tuple[str, str, bytes]] = []  # (id, type, data)
        self.received_at: list[float] = []
        self.done = False

    async def open(self) -> None:
        sock = socket.socket()
        if self.rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        # asyncio reads ahead into the StreamReader up to twice its limit: keep that small for a reader
        # meant to stop, or the client process itself would keep draining the socket.
        limit = 4096 if self.rcvbuf else 1 << 20
        self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=limit)
        resume = f"Last-Event-ID: {self.last_event_id}\r\n" if self.last_event_id else ""
        self.writer.write(f"GET /v1/streams/{self.sid}/events HTTP/1.1\r\nHost: localhost\r\n{resume}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head

    def _parse(self) -> None:
        # The body is chunked (`<hex size>\r\n<data>\r\n`): take whole chunks, then whole events.
        while True:
            size_end = self.buf.find(b"\r\n")
            if size_end < 0:
                return
            size = int(self.buf[:size_end], 16)
            if size == 0:
                self.done = True
                return
            if len(self.buf) < size_end + 2 + size + 2:
                return
            self._body += self.buf[size_end + 2:size_end + 2 + size]
            self.buf = self.buf[size_end + 2 + size + 2:]
            while b"\n\n" in self._body:
                block, self._body = self._body.split(b"\n\n", 1)
                if block.startswith(b":") or block.startswith(b"retry:"):
                    continue
                fields = dict(line.split(b": ", 1) for line in block.split(b"\n"))
                self.events.append((fields[b"id"].decode(), fields[b"event"].decode(), fields[b"data"]))
                self.received_at.append(time.time())
                if fields[b"event"] in (b"done", b"cancelled", b"error"):
                    self.done = True

    _body = b""

    async def read_some(self, n: int = 65536) -> bool:
        """Read what is there (up to n bytes); False at the end of the connection."""
        assert self.reader is not None
        data = await self.reader.read(n)
        if not data:
            return False
        self.buf += data
        self._parse()
        return True

    async def read_to_end(self, timeout_s: float = 60.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not self.done and await self.read_some():
                pass

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _stream(store: StreamStore, jobs: JobStore) -> tuple[str, Claim]:
    sid = uuid.uuid4()
    assert (await store.create(sid, REQ, model="m", max_queue=0, retention_s=600)).created
    claim = await jobs.claim(sid, "test-writer")
    assert isinstance(claim, Claim)
    return str(sid), claim


async def _append(jobs: JobStore, claim: Claim, n: int, size: int, *, batch: int = 50, seq: int = 0) -> int:
    """Append n deltas of ``size`` characters (batch per script call, like a worker); returns the new seq."""
    text = "x" * size
    for i in range(0, n, batch):
        k = min(batch, n - i)
        res = await jobs.append(claim, seq, seq + k, [(EventType.DELTA, encode_data({"text": text}))] * k)
        assert res.ok
        seq += k
        await asyncio.sleep(0)  # pacing: the readers in this process get the loop between batches
    return seq


def test_2000_live_readers_share_a_few_redis_connections(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    # 2,000 readers from one address (127.0.0.1): past the default 1,000 open streams per address, which
    # tests/consumer/test_hostile_clients.py is about; here the subject is the readers' cost.
    proc, url = s.consumer("--heartbeat-s", "10", "--max-streams-per-ip", "0")
    port = int(url.rsplit(":", 1)[1])

    async def run() -> None:
        r = connect(redis_server.url)
        store = StreamStore(r)
        jobs = JobStore(r)
        streams = [await _stream(store, jobs) for _ in range(200)]
        rss0 = psutil.Process(proc.pid).memory_info().rss
        readers = [RawReader(port, streams[i % 200][0]) for i in range(2000)]
        for i in range(0, 2000, 200):  # connect in waves: the listen backlog is finite
            await asyncio.gather(*(rd.open() for rd in readers[i:i + 200]))
        async def all_connected() -> bool:
            return _metric(url, "rsb_connected_readers") >= 2000

        await eventually_async(all_connected, 60, "every reader connected", interval_s=0.2)
        # The consumer's own sockets to Redis, counted from its side, and what Redis says each is doing.
        mine = {f"127.0.0.1:{c.laddr.port}" for c in psutil.Process(proc.pid).net_connections("tcp")
                if c.raddr and c.raddr.port == redis_server.port}
        conns = [cl for cl in redis_client.client_list() if cl["addr"] in mine]
        rss = psutil.Process(proc.pid).memory_info().rss
        print(f"\n2000 live readers: {len(conns)} Redis connections ({sorted(cl['cmd'] for cl in conns)}), "
              f"consumer RSS +{(rss - rss0) / 2**20:.1f} MiB ({(rss - rss0) / 2000 / 1024:.1f} KiB per reader)")
        # The command pool (8 at most) plus one pub/sub connection, whatever the number of readers.
        assert len(conns) <= 8  # the command pool (7) plus the one pub/sub connection
        assert sum(int(cl["sub"]) > 0 for cl in conns) == 1
        # Every stream goes live and ends: each of the 2,000 readers gets its stream's every event.
        for _, claim in streams:
            await _append(jobs, claim, 5, 20)
            await jobs.finish(claim, EventType.DONE, {"finish_reason": "stop", "usage": {}}, status="done", usage={})
        await asyncio.gather(*(rd.read_to_end(60) for rd in readers))
        for i, rd in enumerate(readers):
            assert [t for _, t, _ in rd.events] == ["queued", "delta", "delta", "delta", "delta", "delta", "done"], i
        for rd in readers:
            rd.close()
        await r.aclose()

    asyncio.run(run())


def test_a_reader_that_stops_reading_costs_bounded_memory_and_is_dropped(stack_factory: StackFactory, redis_server: RedisServer,
                                                                          redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    proc, url = s.consumer("--heartbeat-s", "30", "--send-timeout-s", "3")
    port = int(url.rsplit(":", 1)[1])
    pod = psutil.Process(proc.pid)
    n, size = 6000, 4000  # 24 MB of events per stream: a pod that buffered them would show it

    async def phase(store: StreamStore, jobs: JobStore, stuck: bool) -> tuple[int, list[float], RawReader | None, str]:
        """One stream, one reader that reads (and, if ``stuck``, one that stopped); the pod's RSS growth."""
        sid, claim = await _stream(store, jobs)
        reading = RawReader(port, sid)
        await reading.open()
        stopped = None
        if stuck:
            stopped = RawReader(port, sid, rcvbuf=4096)
            await stopped.open()
            await stopped.read_some()  # `queued`, then it never reads again
        await reading.read_some()
        rss0 = pod.memory_info().rss
        peak = rss0

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, pod.memory_info().rss)
                await asyncio.sleep(0.05)  # a sample every 0.05 s

        sampler = asyncio.create_task(sample())
        consume = asyncio.create_task(reading.read_to_end(120))
        await _append(jobs, claim, n, size)
        await jobs.finish(claim, EventType.DONE, {"finish_reason": "stop", "usage": {}}, status="done", usage={})
        await consume
        await asyncio.sleep(0.3)  # deliberate: the sampler's last looks, after the end
        sampler.cancel()
        lat = [t * 1000 - int(eid.split("-")[0]) for (eid, typ, _), t in zip(reading.events, reading.received_at,
                                                                               strict=True) if typ == "delta"]
        assert len(lat) == n and reading.done
        reading.close()
        return peak - rss0, lat, stopped, sid

    async def run() -> None:
        r = connect(redis_server.url)
        store = StreamStore(r)
        jobs = JobStore(r)
        grew_reading, lat_alone, _, _ = await phase(store, jobs, stuck=False)
        grew_stuck, lat_with, stopped, sid = await phase(store, jobs, stuck=True)
        assert stopped is not None
        mib = 2**20
        q_alone, q_with = statistics.quantiles(lat_alone, n=100), statistics.quantiles(lat_with, n=100)
        print(f"\n{n} events x {size} B per stream. Pod RSS growth: {grew_reading / mib:.1f} MiB with a reading "
              f"reader, {grew_stuck / mib:.1f} MiB with a stuck one too. Reading reader's latency p50/p99/max: "
              f"alone {q_alone[49]:.0f}/{q_alone[98]:.0f}/{max(lat_alone):.0f} ms, next to a stuck reader "
              f"{q_with[49]:.0f}/{q_with[98]:.0f}/{max(lat_with):.0f} ms")
        # Bounded: far below the 24 MB the stuck reader did not take, and close to the reading-only case.
        assert grew_stuck < 12 * mib and grew_stuck < grew_reading + 8 * mib
        # The stuck reader never held the other one back (it would wait the 3 s send timeout).
        assert max(lat_with) < 1500

        # Past --send-timeout-s the stuck reader is dropped: the pod holds nothing for it any more ...
        async def dropped() -> bool:
            return _metric(url, "rsb_connected_readers") == 0

        await eventually_async(dropped, 15, "the stuck reader dropped", interval_s=0.1)
        assert "dropping a reader that accepted nothing for 3.0s" in proc.output()
        # ... and reading again, it finds its connection cut mid-stream (it never got the terminal event).
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(15):
                while await stopped.read_some(4096):
                    pass
        assert not stopped.done
        # ... and it resumes from the last whole event it got: the rest, exactly once.
        got = stopped.events
        rest = RawReader(port, sid, last_event_id=got[-1][0])
        await rest.open()
        await rest.read_to_end(60)
        whole = await store.read(uuid.UUID(sid), None, count=n + 10)
        assert [e for e, _, _ in got + rest.events] == [e.id for e in whole]
        assert rest.events[-1][1] == "done"
        rest.close()
        await r.aclose()

    asyncio.run(run())


@pytest.fixture(autouse=True)
def _enough_file_descriptors() -> None:
    """2,000 readers and their 2,000 server-side sockets: raise this process's (and its children's) limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 16384) if hard != resource.RLIM_INFINITY else 16384
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
