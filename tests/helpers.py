"""Test helpers: a strict SSE parser, small HTTP wrappers and readers (no fakes: they talk to real servers), and
`eventually`, the one way a test waits for something to happen."""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson

from broker.errors import RsbError
from broker.events import Event
from broker.sse import ByteDecoder, parse_block
from broker.streams.keys import StreamKeys
from broker.streams.records import Created

T = TypeVar("T")

# Why a test that needs llama.cpp in this process skips: the fast lane runs without the compiled extra.
LLAMA_EXTRA = "llama.cpp is not installed (the [llama] extra: pip install -e '.[test]', or ./scripts/test.sh)"


def eventually(check: Callable[[], T | None], timeout_s: float = 10.0, what: str = "", *, interval_s: float = 0.05) -> T:
    """Call ``check`` until it returns something truthy (returned) and raises no AssertionError, for at most
    ``timeout_s``: a poll with a deadline, never a sleep that hopes the server was quick enough. Past the
    deadline it fails with ``check``'s own last AssertionError, or with ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
            failure: AssertionError | None = None
        except AssertionError as e:
            failure = e
        if time.monotonic() >= deadline:
            if failure is not None:
                raise failure
            raise AssertionError(f"not within {timeout_s}s: {what or check}")
        time.sleep(interval_s)


async def eventually_async(check: Callable[[], Awaitable[T | None]], timeout_s: float = 10.0, what: str = "", *,
                           interval_s: float = 0.05) -> T:
    """``eventually`` for a test on the event loop: ``check`` is a coroutine function, and the wait yields to
    the loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = await check()
            if result:
                return result
            failure: AssertionError | None = None
        except AssertionError as e:
            failure = e
        if time.monotonic() >= deadline:
            if failure is not None:
                raise failure
            raise AssertionError(f"not within {timeout_s}s: {what or check}")
        await asyncio.sleep(interval_s)


async def until(check: Callable[[], T | None], timeout_s: float = 10.0, what: str = "", *,
                interval_s: float = 0.05) -> T:
    """``eventually_async`` of a plain ``check``: a look at what the loop's tasks change (a hub's channels, a
    slot's state), made between the loop's turns."""

    async def look() -> T | None:
        return check()

    return await eventually_async(look, timeout_s, what or str(check), interval_s=interval_s)


@dataclass
class SSE:
    id: str | None
    event: str | None
    data: Any
    raw: bytes


@dataclass
class SSERead:
    status: int
    headers: httpx.Headers
    events: list[SSE]
    comments: list[tuple[float, bytes]]  # (monotonic time, comment line)
    retry: list[int]

    @property
    def text(self) -> str:
        return "".join(e.data["text"] for e in self.events if e.event == "delta")

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.events if e.id is not None]


def parse_sse_block(block: bytes) -> SSE | tuple[str, bytes]:
    """One block of rsb's native framing, parsed by broker.sse and checked strictly: each field once, an
    event has exactly id, event and data (one line of JSON)."""
    parsed = parse_block(block)
    names = [name for name, _ in parsed.fields]
    assert len(names) == len(set(names)), f"a field repeated in one event: {block!r}"
    if not names and parsed.comments:
        return ("comment", b":" + parsed.comments[-1].encode())
    if names == ["retry"]:
        return ("retry", dict(parsed.fields)["retry"].encode())
    assert set(names) == {"id", "event", "data"}, f"unexpected event fields: {block!r}"
    return SSE(parsed.id, parsed.event, orjson.loads(parsed.data), block)


def read_sse(client: httpx.Client, url: str, *, headers: dict[str, str] | None = None,
             params: dict[str, str] | None = None, stop_after: int | None = None,
             timeout_s: float = 60.0, on_event: Callable[[SSE], None] | None = None) -> SSERead:
    """Read an SSE response to its end (or ``stop_after`` events), checking the framing of every byte;
    ``on_event`` is told of each event as it arrives."""
    events: list[SSE] = []
    comments: list[tuple[float, bytes]] = []
    retry: list[int] = []
    deadline = time.monotonic() + timeout_s
    with client.stream("GET", url, headers=headers, params=params, timeout=httpx.Timeout(timeout_s)) as r:
        if r.status_code != 200:
            r.read()
            return SSERead(r.status_code, r.headers, [], [], [])
        for parsed in sse_blocks(r):
            if isinstance(parsed, SSE):
                events.append(parsed)
                if on_event is not None:
                    on_event(parsed)
            elif parsed[0] == "comment":
                comments.append((time.monotonic(), parsed[1]))
            else:
                retry.append(int(parsed[1]))
            if stop_after is not None and len(events) >= stop_after:
                break
            assert time.monotonic() < deadline, "SSE read did not finish in time"
        return SSERead(r.status_code, r.headers, events, comments, retry)


def sse_blocks(response: httpx.Response) -> Iterator[SSE | tuple[str, bytes]]:
    """The blocks of a native SSE response as they arrive, parsed strictly; a body that ends mid-event
    fails (the server must close at a frame boundary)."""
    decoder = ByteDecoder()
    for chunk in response.iter_raw():
        for block in decoder.feed(chunk):
            yield parse_sse_block(block)
    assert decoder.pending == b"", f"response ended mid-event: {decoder.pending!r}"


@dataclass(frozen=True)
class CliSetting:
    flag: str  # --shutdown-grace-s
    env: str  # RSB_SHUTDOWN_GRACE_S
    default: str | None  # rendered as a flag value ("5.0"); None when it has none


@dataclass(frozen=True)
class CliCommand:
    """What ``rsb <name>`` accepts, read from the settings classes behind it (the deployment files are checked
    against this, not against a list kept by hand)."""

    name: str
    settings: dict[str, CliSetting]  # by env name

    @property
    def flags(self) -> set[str]:
        out = {s.flag for s in self.settings.values()}
        return out | {"--no-" + f[2:] for f in out}  # switches also take a --no- form

    def value(self, env: dict[str, str], name: str) -> str:
        """The value a process gets for setting ``name`` (an RSB_* name) from ``env``, else its default."""
        if name in env:
            return env[name]
        default = self.settings[name].default
        assert default is not None, f"{name} has no default in `rsb {self.name}`"
        return default

    def number(self, env: dict[str, str], name: str) -> float:
        return float(self.value(env, name))

    def effective(self, env: dict[str, str], args: list[str], name: str) -> str:
        """The value from a command line's flags (they win over the variables), else from ``env``, else the
        default."""
        flags = flag_values(args)
        flag = self.settings[name].flag
        return flags[flag] if flag in flags else self.value(env, name)


@functools.cache
def cli_command(name: str) -> CliCommand:
    from rsb.cli import COMMANDS

    cmd = next(c for c in COMMANDS if c.name == name)
    settings = {opt.env: CliSetting(f"--{opt.flag}", opt.env, None if opt.default is None else opt.render(opt.default))
                for opt in cmd.settings.options()}
    return CliCommand(name, settings)


def flag_values(args: list[str]) -> dict[str, str]:
    """``--port 8000`` / ``--port=8000`` / ``--log-content`` (a switch: "true") from a command line."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"unexpected argument {arg!r} in {args}"
        if "=" in arg:
            name, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            name, value = arg, args[i + 1]
            i += 1
        else:
            name, value = arg, "true"
        out[name] = value
        i += 1
    return out


def create_outcome(result: Created | BaseException) -> str:
    """What a StreamStore.create call came to: created, exists, or the code of the error it raised."""
    if isinstance(result, Created):
        return "created" if result.created else "exists"
    assert isinstance(result, RsbError), result
    return result.code


def create(client: httpx.Client, body: dict[str, Any] | None = None, **fields: Any) -> httpx.Response:
    payload: dict[str, Any] = {"id": str(uuid.uuid4()), "prompt": "Hello", "max_tokens": 16}
    payload.update(body or {})
    payload.update(fields)
    if "messages" in payload:
        payload.pop("prompt")
    return client.post("/v1/streams", json=payload)


def wait_status(client: httpx.Client, sid: str, statuses: set[str], timeout_s: float = 60.0) -> dict[str, Any]:
    def reached() -> dict[str, Any]:
        r = client.get(f"/v1/streams/{sid}")
        assert r.status_code == 200 and r.json()["status"] in statuses, f"stream {sid} never reached {statuses}: {r.text}"
        return dict(r.json())

    return eventually(reached, timeout_s)


# The commonest English words: a real model's answer is full of them, random-weight gibberish is not.
COMMON_ENGLISH = frozenset(
    "the a an is are was be it its of and or to in on for with that this as by can from at which not you".split())


def assert_english(text: str, min_words: int = 20) -> None:
    """``text`` reads as English prose: mostly ASCII letters and spaces, sentences of real words, and at least a
    fifth of its words among the commonest English ones."""
    assert text.strip(), "the answer is empty"
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters / len(text) > 0.85, f"not mostly ASCII letters and spaces: {text!r}"
    words = [w.strip(".,;:!?()*`'\"").lower() for w in text.split()]
    words = [w for w in words if w]
    assert len(words) >= min_words, f"only {len(words)} words: {text!r}"
    common = sum(w in COMMON_ENGLISH for w in words)
    assert common / len(words) > 0.2, f"few common English words ({common}/{len(words)}): {text!r}"

def metric(text: str, name: str) -> float:
    """One sample of a Prometheus text exposition (``rsb_connected_readers``, or a name with its labels), 0 if
    absent (a counter nothing has incremented yet)."""
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def connected_readers(base_url: str, headers: dict[str, str] | None = None) -> float:
    """``headers``: an API key, for a consumer with keys (its /metrics needs one)."""
    return metric(httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text, "rsb_connected_readers")


def wait_readers_sync(base_url: str, n: float, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> None:
    """Until the consumer at ``base_url`` counts at least ``n`` connected readers (SSE and long-polls)."""
    eventually(lambda: connected_readers(base_url, headers) >= n, timeout_s, f"{n} connected readers")


async def wait_readers(client: httpx.AsyncClient, n: int, timeout_s: float) -> None:
    """Wait until the consumer behind ``client`` counts ``n`` connected readers (its /metrics)."""
    async def enough() -> bool:
        readers = metric((await client.get("/metrics")).text, "rsb_connected_readers")
        assert readers >= n, f"only {readers} of {n} readers connected"
        return True

    await eventually_async(enough, timeout_s)


# -- a reader that reconnects like a browser's EventSource -----------------------------------------------


class ResumingRead:
    """What a reconnecting reader saw: every event once (by id), how each connection ended, when each event
    arrived (wall clock, to compare with the event id's millisecond part: the append time in Redis)."""

    def __init__(self) -> None:
        self.events: list[SSE] = []
        self.received_at: list[float] = []
        self.ends: list[str] = []  # per connection: "clean" (the server ended the body) or "error"
        self.retry: list[int] = []
        self.errors: list[str] = []
        self.done = False

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.events if e.id is not None]


def read_resuming(base_url: str, sid: str, *, max_connections: int = 10, timeout_s: float = 60.0,
                  into: ResumingRead | None = None) -> ResumingRead:
    """Read a stream to its terminal event, reconnecting with Last-Event-ID whenever a connection ends
    early (a draining pod's clean close, a killed pod's cut): what a browser's EventSource does, without
    the `retry:` wait. Each connection is new, so a balancer may send it to another pod."""
    out = into or ResumingRead()
    deadline = time.monotonic() + timeout_s
    while not out.done:
        assert len(out.ends) < max_connections, f"gave up after {len(out.ends)} connections: {out.ends}"
        assert time.monotonic() < deadline, "the stream did not end in time"
        headers = {"Last-Event-ID": out.ids[-1]} if out.events else {}
        try:
            with httpx.Client(base_url=base_url, timeout=httpx.Timeout(10.0)) as c, \
                    c.stream("GET", f"/v1/streams/{sid}/events", headers=headers) as r:
                if r.status_code == 204:  # resumed at the terminal event
                    out.done = True
                    out.ends.append("clean")
                    break
                assert r.status_code == 200, r.status_code
                for parsed in sse_blocks(r):
                    if isinstance(parsed, SSE):
                        out.events.append(parsed)
                        out.received_at.append(time.time())
                        if parsed.event in ("done", "cancelled", "error"):
                            out.done = True
                    elif parsed[0] == "retry":
                        out.retry.append(int(parsed[1]))
            out.ends.append("clean")
        except (httpx.HTTPError, OSError) as e:
            out.ends.append("error")  # cut mid-stream: a partial event was dropped, and is read again
            out.errors.append(repr(e))
            time.sleep(0.05)  # a client's pause before it resumes
    return out


def parse_bytes(size: str) -> int:
    """A Redis, compose or Kubernetes memory size (``1gb``, ``2g``, ``512mb``, ``1Gi``) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)(i?b?)", size.strip().lower())
    assert m, f"bad size {size!r}"
    return int(m.group(1)) * int(1024 ** " kmg".index(m.group(2) or " "))


def stored_events(client: Any, sid: str, partitions: int = 1) -> list[Event]:
    """The events a stream holds in Redis now (``client``: a redis-py client), without waiting for more."""
    key = StreamKeys.of(uuid.UUID(sid), partitions).events
    return [Event.from_entry(eid, fields) for eid, fields in client.xrange(key)]


def stored_text(client: Any, sid: str, partitions: int = 1) -> str:
    """The answer's text a stream holds in Redis now (its deltas so far)."""
    return "".join(e.json()["text"] for e in stored_events(client, sid, partitions) if e.type == "delta")
