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

**Draining** (SIGTERM): uvicorn closes every idle keep-alive connection at once, but a balancer may have sent a
request on one a moment before (nginx reuses idle upstream connections, and learns a pod drains only from its
failures): closed unread, that request is lost (nginx answers the client 502 and, for a POST, does not retry). So
an idle connection is closed ``DRAIN_IDLE_S`` later instead; a request that comes meanwhile is served, and the
connection closed after its answer. New connections are refused (the listening socket is closed): a balancer
tries the next pod.

The **write-stall guard** (``stall_guarded``) drops a connection whose client stopped reading. And the
protocol tells a response that its client left without a task waiting in ``receive`` (``watch_disconnect``):
an open SSE reader otherwise holds a task, its coroutine and an event's waiter (~2 KiB) only to learn that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterable
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
#: Draining: how long an idle keep-alive connection stays open for a request its balancer had already sent on it.
DRAIN_IDLE_S = 1.0
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
        __slots__ = ("_guard_closing", "_guard_cycle", "_guard_group", "_guard_head_bytes", "_guard_on_lost",
                     "_guard_timer")
        _guard_group: str | None
        _guard_timer: asyncio.TimerHandle | None
        _guard_cycle: object  # the request cycle whose body the timer waits for; None: a request head
        _guard_head_bytes: int
        _guard_on_lost: Callable[[], None] | None  # watch_disconnect's callback for the running cycle
        _guard_closing: bool  # draining: closed after its next answer (see the module doc)

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._guard_group, self._guard_timer, self._guard_cycle, self._guard_head_bytes = None, None, None, 0
            self._guard_on_lost, self._guard_closing = None, False
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
            if self._guard_closing:  # draining: this connection's last answer
                self.transport.close()
                return
            self._guard_follow()  # a pipelined request may have started

        def shutdown(self) -> None:
            """Draining (see the module doc): an idle connection stays DRAIN_IDLE_S for a request already sent."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                super().shutdown()  # a request in flight: closed after its answer (uvicorn's own way)
                return
            self._guard_closing = True
            self.loop.call_later(DRAIN_IDLE_S, self._guard_close_idle)

        def _guard_close_idle(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_disarm()
            if self._guard_group is not None:
                by_group[self._guard_group] -= 1
                if by_group[self._guard_group] <= 0:
                    del by_group[self._guard_group]
                self._guard_group = None
            on_lost, self._guard_on_lost = self._guard_on_lost, None
            super().connection_lost(exc)
            if on_lost is not None:
                on_lost()

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


def stall_guarded(base: type[asyncio.Protocol], stall_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a write-stall guard.

    uvicorn already applies flow control: once a connection's transport buffer passes asyncio's high-water
    mark (64 KiB) it pauses, and the app's next ``send`` waits for the client to read. That bounds what
    a pod buffers per connection, but a client that never reads again (a frozen tab, a stalled proxy)
    would keep the connection, its buffer and its reader forever: closing it politely (``close()``)
    waits for the buffer to flush, which never happens. This guard aborts the connection once writing
    has been paused for ``stall_timeout_s`` without the client taking anything; the app sees a
    disconnect, frees the reader, and the client resumes from its last event id when it comes back."""

    class StallGuarded(base):  # type: ignore[valid-type,misc]
        _stall_timer: asyncio.TimerHandle | None = None
        stall_timeout_s: float

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(stall_timeout_s, self._abort_stalled)

        def resume_writing(self) -> None:
            self._disarm()
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _abort_stalled(self) -> None:
            self._stall_timer = None
            log.info("dropping a reader that accepted nothing for %.1fs", stall_timeout_s,
                     extra={"client": f"{self.client[0]}:{self.client[1]}" if self.client else ""})
            self.transport.abort()  # connection_lost follows: the app sees http.disconnect

    StallGuarded.stall_timeout_s = stall_timeout_s
    StallGuarded.__name__ = StallGuarded.__qualname__ = f"StallGuarded{base.__name__}"
    return StallGuarded


def _protocol_of(receive: Callable[..., Any]) -> Any:
    """The connection protocol whose request cycle ``receive`` belongs to, or None (a middleware wrapped it)."""
    cycle = getattr(receive, "__self__", None)
    transport: asyncio.BaseTransport | None = getattr(cycle, "transport", None)
    if transport is None:
        return None
    protocol: Any = transport.get_protocol()
    return protocol if getattr(protocol, "cycle", None) is cycle else None


def guards_stalls(receive: Callable[..., Any], timeout_s: float) -> bool:
    """Whether the connection of ``receive`` is dropped by ``stall_guarded`` once its client accepted nothing for
    ``timeout_s`` or less: a response there needs no timer of its own for the same rule."""
    protocol = _protocol_of(receive)
    limit = getattr(type(protocol), "stall_timeout_s", None)
    return limit is not None and limit <= timeout_s


def watch_disconnect(receive: Callable[..., Any], on_lost: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``on_lost`` when the client of the request whose ASGI ``receive`` this is goes away; returns what
    stops watching, or None when this connection cannot be watched so (not a guarded protocol's own cycle: a
    middleware wrapped ``receive``): the caller then waits in ``receive`` as usual. ``on_lost`` runs at once
    (soon) if the client is gone already.

    Only a response that reads no body may use it: nothing else consumes the request's messages. A client
    that pipelined a second request has its connection's reading paused (uvicorn's flow control, until this
    response ends), so its leaving is learnt at the next write instead: a heartbeat at the latest."""
    protocol = _protocol_of(receive)
    if protocol is None or not hasattr(type(protocol), "_guard_on_lost"):
        return None
    if protocol.cycle.disconnected or protocol.transport.is_closing():
        asyncio.get_running_loop().call_soon(on_lost)
        return lambda: None
    protocol._guard_on_lost = on_lost

    def stop() -> None:
        if protocol._guard_on_lost is on_lost:
            protocol._guard_on_lost = None

    return stop
