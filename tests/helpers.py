"""Test helpers: a strict SSE parser and small HTTP wrappers (no fakes: they talk to real servers)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from broker.errors import RsbError
from broker.sse import ByteDecoder, parse_block
from broker.streams.records import Created


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
             timeout_s: float = 60.0) -> SSERead:
    """Read an SSE response to its end (or ``stop_after`` events), checking the framing of every byte."""
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
    """What a Store.create call came to: created, exists, or the code of the error it raised."""
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
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.get(f"/v1/streams/{sid}")
        if r.status_code == 200 and r.json()["status"] in statuses:
            return dict(r.json())
        assert time.monotonic() < deadline, f"stream {sid} never reached {statuses}: {r.text}"
        time.sleep(0.05)


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

async def wait_readers(client: httpx.AsyncClient, n: int, timeout_s: float) -> None:
    """Wait until the consumer behind ``client`` counts ``n`` connected readers (its /metrics)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        m = (await client.get("/metrics")).text
        readers = next(float(line.split()[1]) for line in m.splitlines() if line.startswith("rsb_connected_readers "))
        if readers >= n:
            return
        assert time.monotonic() < deadline, f"only {readers} of {n} readers connected"
        await asyncio.sleep(0.05)
