"""Readers that record their whole history, and the check of that history against the stream as it ended.

A ``HistoryReader`` is what a browser's EventSource does, on a thread: it reads a stream's events, and whenever its
connection ends before the terminal event (a clean close, a cut, a ``503`` while its pod cannot reach Redis, a pod
that is gone) it connects again, to the next of its pods, with ``Last-Event-ID``. It keeps each connection's events
apart (a ``Segment``: the id it resumed after, what it got, how it ended).

``check_history`` holds every segment to the final stream (its events read from Redis once it ended): each one
starts right after the id it resumed from and is the stream's very next events, in order (no gap, no duplicate, no
reorder: each resume exact), with the data Redis holds; and the reader, once done, got the whole stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from helpers import SSE, sse_blocks

from broker.events import Event

TERMINAL = ("done", "cancelled", "error")


@dataclass
class Segment:
    after: str | None  # the Last-Event-ID this connection sent (None: from the start)
    events: list[SSE] = field(default_factory=list)
    end: str = ""  # "clean", "cut", "http <status>", "refused"
    heartbeats: int = 0


class HistoryReader:
    """Reads ``sid`` to its end on a thread of its own, reconnecting to ``base_urls`` in turn (see the module doc).
    ``join()`` it; ``done`` says it got the terminal event."""

    def __init__(self, base_urls: Sequence[str], sid: str, *, timeout_s: float = 120.0, read_timeout_s: float = 20.0,
                 pause_s: float = 0.2) -> None:
        self.base_urls = list(base_urls)
        self.sid = sid
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self.pause_s = pause_s
        self.segments: list[Segment] = []
        self.done = False
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"reader-{sid[:8]}", daemon=True)

    def start(self) -> HistoryReader:
        self._thread.start()
        return self

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(self.timeout_s + 10 if timeout_s is None else timeout_s)
        if self.failure is not None:
            raise self.failure
        assert not self._thread.is_alive(), f"reader of {self.sid} still reading"

    @property
    def last_id(self) -> str | None:
        for seg in reversed(self.segments):
            if seg.events:
                return seg.events[-1].id
            if seg.after is not None:
                return seg.after
        return None

    def _run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            turn = 0
            while not self.done:
                assert time.monotonic() < deadline, f"reader of {self.sid} did not finish: {self.ends()}"
                url = self.base_urls[turn % len(self.base_urls)]
                turn += 1
                seg = Segment(self.last_id)
                self.segments.append(seg)
                self._read(url, seg)
                if not self.done:
                    time.sleep(self.pause_s)
        except BaseException as e:  # handed to join()
            self.failure = e

    def _read(self, url: str, seg: Segment) -> None:
        headers = {"Last-Event-ID": seg.after} if seg.after else {}
        timeout = httpx.Timeout(self.read_timeout_s, connect=2.0)
        try:
            with httpx.Client(base_url=url, timeout=timeout) as c, \
                    c.stream("GET", f"/v1/streams/{self.sid}/events", headers=headers) as r:
                if r.status_code == 204:  # resumed at the terminal event: the end was received before
                    seg.end, self.done = "clean", True
                    return
                if r.status_code != 200:
                    r.read()
                    seg.end = f"http {r.status_code}"
                    return
                for parsed in sse_blocks(r):
                    if isinstance(parsed, SSE):
                        seg.events.append(parsed)
                        if parsed.event in TERMINAL:
                            self.done = True
                    elif parsed[0] == "comment":
                        seg.heartbeats += 1
            seg.end = "clean"
        except httpx.ConnectError:
            seg.end = "refused"
        except (httpx.HTTPError, OSError):
            seg.end = "cut"  # a partial event was dropped, and is read again

    def ends(self) -> list[str]:
        return [s.end for s in self.segments]

    @property
    def events(self) -> list[SSE]:
        return [e for s in self.segments for e in s.events]


def check_history(reader: HistoryReader, final: Sequence[Event]) -> None:
    """Hold ``reader``'s history to the final stream (see the module doc); raises AssertionError naming the first
    difference."""
    ids = [e.id for e in final]
    index = {eid: i for i, eid in enumerate(ids)}
    assert len(index) == len(ids), "the stream itself holds an id twice"
    assert final and final[-1].type in TERMINAL, "the stream has not ended"
    for n, seg in enumerate(reader.segments):
        start = 0 if seg.after is None else index.get(seg.after, -1) + 1
        assert seg.after is None or seg.after in index, f"segment {n} resumed after {seg.after}, not in the stream"
        for k, ev in enumerate(seg.events):
            assert ev.event != "reset", f"segment {n}: a reset (no failover here may lose an event a reader saw)"
            i = start + k
            assert i < len(final), f"segment {n}: event {ev.id} past the stream's end"
            want = final[i]
            assert ev.id == want.id, (f"segment {n} (after {seg.after}): event {k} is {ev.id}, the stream's next is "
                                      f"{want.id}: a gap, a duplicate or a reorder")
            assert (ev.event, ev.data) == (want.type, want.json()), f"segment {n}: {ev.id} differs from Redis's"
    assert reader.done, f"the reader did not finish: {reader.ends()}"
    got = [e.id for e in reader.events]
    assert got == ids, "the reader's events, connection after connection, are not the stream's, once each"
