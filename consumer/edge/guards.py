"""HTTP hygiene below the app: what a client can do with bare TCP connections, bounded before any ASGI work.

A connection costs the pod a file descriptor and some memory before it has sent a single byte, and uvicorn
alone bounds neither how long a request head may take nor how many connections one address holds (its
keep-alive timer only runs *between* requests). So, per connection, at the protocol level:

- **head timeout**: a request head not complete ``head_timeout_s`` after the connection opened (or after
  the first byte of its next request) closes the connection (slowloris: half a request line, then
  nothing). A head over ``MAX_HEAD_BYTES`` closes it too (h11 stops at 16 KiB on its own; httptools would
  not).
- **body timeout**: a body not received whole ``body_timeout_s`` after its head closes the connection.
- **connections per peer address group** (an IPv4 address, an IPv6 /64: one host is given a whole /64):
  past ``per_address`` the request is answered ``429 too_many_connections`` + ``Retry-After`` and the
  connection closed; past twice that, the socket is closed at once. Peers that are trusted proxies
  (``--forwarded-allow-ips``) are exempt: their connections carry many clients, which the app counts by
  forwarded address (consumer.edge.limits).
- **connections of the pod**: past ``total`` (90% of the open-file limit by default) the request is
  answered ``503 overloaded``; past ``hard_total`` the socket is closed at once, so the pod never runs out
  of file descriptors (Redis connections, files) whatever arrives.

A refused connection gets ``REFUSED_HEAD_TIMEOUT_S`` to send its head (a real client sends it at once), so
a flood of them holds descriptors for no longer than that.

It works with both of uvicorn's HTTP/1.1 protocols (h11, httptools: whichever ``AutoHTTPProtocol`` is) by
using only what they share: ``self.cycle`` becomes a new request cycle when a head is complete, its
``more_body`` turns False once the body is, ``response_complete`` once the response is; ``self.app`` is
what a new cycle runs; ``on_response_complete`` is called after each response; ``self.connections`` is
every open connection of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from broker.errors import InvalidRequest, Overloaded, TooManyConnections
from consumer.edge.errors import STATUS, refusal
from consumer.edge.limits import TrustedProxies, address_group

log = logging.getLogger("rsb.consumer")

MAX_HEAD_BYTES = 64 * 1024
REFUSED_HEAD_TIMEOUT_S = 2.0
REFUSED_RETRY_AFTER_S = 2
# One warning per kind of refusal per this many seconds: a flood must not become a flood of log lines.
WARN_EVERY_S = 10.0
# Descriptors kept for what is not a client connection (Redis, files, the listening socket).
RESERVED_FDS = 64


def open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (a server should: the soft default is
    often 1024), and return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want if soft == resource.RLIM_INFINITY else soft
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass(frozen=True, slots=True)
class Guards:
    head_timeout_s: float
    body_timeout_s: float
    per_address: int  # 0: no cap
    total: int
    hard_total: int
    trusted: TrustedProxies

    @classmethod
    def derive(cls, *, head_timeout_s: float, body_timeout_s: float, per_address: int, max_connections: int,
               trusted: Iterable[str], fd_limit: int) -> Guards:
        """``max_connections`` 0: 90% of ``fd_limit``. The sockets closed at once start where only the last
        5% of the descriptors (at least RESERVED_FDS) would be left."""
        total = max_connections or int(fd_limit * 0.9)
        hard_total = max(total, fd_limit - max(RESERVED_FDS, fd_limit // 20))
        return cls(head_timeout_s, body_timeout_s, per_address, total, hard_total, TrustedProxies(trusted))


class _Warner:
    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.count: Counter[str] = Counter()

    def __call__(self, kind: str, message: str, **extra: Any) -> None:
        self.count[kind] += 1
        now = time.monotonic()
        if now - self.last.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self.last[kind] = now
            log.warning(message, extra={**extra, "since_last_warning": self.count[kind]})
            self.count[kind] = 0


def malformed_request_response(msg: str) -> bytes:
    """The whole HTTP/1.1 response to a request that cannot be parsed: 400 invalid_request, JSON, closing."""
    status = STATUS[InvalidRequest.code]
    body = orjson.dumps({"error": {"code": InvalidRequest.code, "message": f"malformed HTTP request: {msg}"}})
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def guarded(base: type[asyncio.Protocol], guards: Guards) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``base`` with the guards of the module doc. Each call makes a class with its
    own per-address counts: one per server."""
    by_group: Counter[str] = Counter()
    warn = _Warner()

    close = {"Connection": "close"}
    per_address_app = refusal(TooManyConnections(
        f"too many connections from this address (limit {guards.per_address}); close some or retry later",
        REFUSED_RETRY_AFTER_S), close)
    overloaded_app = refusal(Overloaded(
        "this server holds as many connections as it may; retry (another server may answer)",
        REFUSED_RETRY_AFTER_S), close)

    # Every name this class adds starts with _guard_: it is mixed into uvicorn's protocol and under other
    # wrappers (consumer.server's stall guard), where a shared name would silently override another's. They
    # are slots, not instance attributes: a few more keys in uvicorn's already large instance dict would
    # end its key sharing and cost every connection about 1 KiB.
    class Guarded(base):  # type: ignore[valid-type,misc]
        __slots__ = ("_guard_cycle", "_guard_group", "_guard_head_bytes", "_guard_timer")
        _guard_group: str | None
        _guard_timer: asyncio.TimerHandle | None
        _guard_cycle: object  # the request cycle whose body the timer waits for; None: a request head
        _guard_head_bytes: int

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._guard_group, self._guard_timer, self._guard_cycle, self._guard_head_bytes = None, None, None, 0
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            app = None
            if guards.per_address and host is not None and host not in guards.trusted:
                self._guard_group = group = address_group(host)
                by_group[group] += 1
                if by_group[group] > 2 * guards.per_address:
                    warn("per_address_abort", "closing connections of an address far past its cap", group=group)
                    self.transport.abort()
                    return
                if by_group[group] > guards.per_address:
                    warn("per_address", "refusing connections of an address past its cap (429)", group=group)
                    app = per_address_app
            total = len(self.connections)
            if total > guards.hard_total:
                warn("total_abort", "closing new connections: the pod is at its descriptor reserve",
                     connections=total)
                self.transport.abort()
                return
            if app is None and total > guards.total:
                warn("total", "refusing connections: the pod holds its maximum (503)", connections=total)
                app = overloaded_app
            if app is not None:
                # uvicorn's protocol has an instance dict: only this class's own names are slots.
                self.app = app  # type: ignore[misc]
                self._guard_arm(min(REFUSED_HEAD_TIMEOUT_S, guards.head_timeout_s), None)
            else:
                self._guard_arm(guards.head_timeout_s, None)

        def data_received(self, data: bytes) -> None:
            if self._guard_reading_head():
                if self._guard_timer is None:  # the first byte of a request after a keep-alive pause
                    self._guard_arm(guards.head_timeout_s, None)
                self._guard_head_bytes += len(data)
            super().data_received(data)
            self._guard_follow()
            too_long = self._guard_head_bytes > MAX_HEAD_BYTES
            if too_long and self._guard_reading_head() and not self.transport.is_closing():
                warn("head_size", "closing a connection whose request head passed its size limit")
                self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._guard_follow()  # a pipelined request may have started

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_disarm()
            if self._guard_group is not None:
                by_group[self._guard_group] -= 1
                if by_group[self._guard_group] <= 0:
                    del by_group[self._guard_group]
                self._guard_group = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request uvicorn's parser refuses (a control character in a header, a malformed request line)
            is answered as every error is, JSON with a code, not uvicorn's text/plain; then closed, as uvicorn
            does (the parser's state is lost)."""
            self.transport.write(malformed_request_response(msg))
            self.transport.close()

        def _guard_reading_head(self) -> bool:
            """Whether the next bytes are a request head: no request yet, or the last one answered and
            received whole. An answer may come before its body is in (a 413): the rest of that body still
            arrives (uvicorn drains it), and its bytes are neither a head nor counted as one; the body's
            timer keeps running meanwhile."""
            cycle = self.cycle
            return cycle is None or bool(cycle.response_complete and not cycle.more_body)

        def _guard_follow(self) -> None:
            """Move the timer on to the phase the connection is in now."""
            if self._guard_reading_head():
                return  # still a head: its timer runs
            self._guard_head_bytes = 0
            cycle = self.cycle
            if cycle.more_body:
                if self._guard_cycle is not cycle:
                    self._guard_arm(guards.body_timeout_s, cycle)
            elif self._guard_timer is not None:
                self._guard_disarm()

        def _guard_arm(self, timeout_s: float, for_cycle: object) -> None:
            self._guard_disarm()
            self._guard_timer = self.loop.call_later(timeout_s, self._guard_expired)
            self._guard_cycle = for_cycle

        def _guard_disarm(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer = None
            self._guard_cycle = None

        def _guard_expired(self) -> None:
            phase = "head" if self._guard_cycle is None else "body"
            self._guard_timer = None
            self._guard_cycle = None
            warn(f"{phase}_timeout", f"closing connections whose request {phase} did not arrive in time")
            # abort, not close: nothing is owed to this client, and its descriptor is freed now.
            self.transport.abort()  # connection_lost follows (the app, if it runs, sees a disconnect)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
