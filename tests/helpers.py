"""Test helpers: a strict SSE parser and small HTTP wrappers (no fakes: they talk to real servers)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson


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
    fields: dict[str, str] = {}
    comment = None
    for line in block.split(b"\n"):
        if line.startswith(b":"):
            comment = line
            continue
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        key = name.decode()
        assert key not in fields, f"field {key} repeated in one event: {block!r}"
        fields[key] = value.decode()
    if not fields and comment is not None:
        return ("comment", comment)
    if set(fields) == {"retry"}:
        return ("retry", fields["retry"].encode())
    assert set(fields) == {"id", "event", "data"}, f"unexpected event fields: {block!r}"
    return SSE(fields["id"], fields["event"], orjson.loads(fields["data"]), block)


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
        buf = b""
        for chunk in r.iter_raw():
            buf += chunk
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                parsed = parse_sse_block(block)
                if isinstance(parsed, SSE):
                    events.append(parsed)
                elif parsed[0] == "comment":
                    comments.append((time.monotonic(), parsed[1]))
                else:
                    retry.append(int(parsed[1]))
            if stop_after is not None and len(events) >= stop_after:
                break
            assert time.monotonic() < deadline, "SSE read did not finish in time"
        else:
            assert buf == b"", f"response ended mid-event: {buf!r}"
        return SSERead(r.status_code, r.headers, events, comments, retry)


def wait_serving(url: str, alive: Callable[[], bool], describe: Callable[[], str], timeout_s: float) -> None:
    """Poll ``url`` until it answers 200, failing at once (with ``describe()``) if the process died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert alive(), f"the server died:\n{describe()}"
        assert time.monotonic() < deadline, f"{url} did not come up in {timeout_s:g}s:\n{describe()}"
        time.sleep(0.05)


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
