"""A TCP fault proxy the tests control, put between one rsb process and Redis: the network's faults, on demand.

No maintained one installs here (toxiproxy is a Go binary on GitHub, in no Debian or PyPI package), so this is the
project's own: an asyncio proxy on a thread of its own, so a synchronous test drives it with plain method calls.
One proxy per process under test (``FaultProxy(redis_port).url``), each link (an accepted connection and its
connection to Redis) pumped both ways. The faults:

- ``latency(s)``: every byte is delivered ``s`` later, each way (a round trip gains ``2 * s``), order kept.
- ``dark()``: a half-open link. Nothing is forwarded any more, either way, and nothing tells either end: no FIN, no
  RST (the proxy stops reading, so what is sent piles up in the kernel's buffers, as in a network that drops
  packets). ``new_too=True`` (the default) makes connections made meanwhile dark too (accepted, never answered:
  a partition); ``new_too=False`` only the existing ones (a NAT or conntrack entry lost: a new connection works).
- ``heal()``: the dark links flow again, and what was sent meanwhile is delivered then (TCP's retransmissions):
  a command sent into a partition lands late. Latency stays.
- ``reset()``: every open link gets an RST on its client side (and its Redis side is closed); new ones work.
- ``refuse()``: new connections are reset at once and existing ones too (a host that is down answers RST), until
  ``heal()``.
- ``retarget(port)``: new links go to another server, and the open ones are reset (a service address moved to a
  promoted replica: a failover behind one name).

``links`` counts the links open now and ``accepted`` every one ever accepted: a test waits for a reconnect by them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_READ_BYTES = 1 << 16
_SEEN_BYTES = 4096


class _Link:
    """One client connection and its connection to Redis."""

    def __init__(self, proxy: FaultProxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.proxy = proxy
        self.client_r, self.client_w = client
        self.server_w: asyncio.StreamWriter | None = None
        # Set while the link forwards; cleared while it is dark.
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.tasks: set[asyncio.Task[None]] = set()
        #: The first bytes the client sent: which link is which (a pub/sub connection sent SUBSCRIBE).
        self.sent = b""

    async def run(self) -> None:
        try:
            server_r, self.server_w = await asyncio.open_connection(self.proxy.target_host, self.proxy.target_port)
        except OSError:
            self.abort()
            return
        up = asyncio.ensure_future(self._pump(self.client_r, self.server_w))
        down = asyncio.ensure_future(self._pump(server_r, self.client_w))
        self.tasks = {up, down}
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        self.abort(rst=False)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        upstream = src is self.client_r
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        deliver = asyncio.ensure_future(self._deliver(queue, dst))
        try:
            while True:
                await self.flowing.wait()
                try:
                    data = await src.read(_READ_BYTES)
                except OSError:
                    data = b""
                # Read before the link went dark: held (as the kernel would, with the packets in flight lost) until
                # it flows again.
                await self.flowing.wait()
                if upstream and len(self.sent) < _SEEN_BYTES:
                    self.sent += data[:_SEEN_BYTES]
                queue.put_nowait((time.monotonic() + self.proxy.delay_s, data))
                if not data:
                    break
            await deliver
        finally:
            deliver.cancel()

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter) -> None:
        while True:
            at, data = await queue.get()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.flowing.wait()
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            try:
                dst.write(data)
                await dst.drain()
            except OSError:
                return

    def abort(self, rst: bool = True) -> None:
        """Close both sides: the client's with an RST (``rst``), Redis's plainly."""
        for t in self.tasks:
            t.cancel()
        if rst:
            sock = self.client_w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.client_w.transport.abort()
        else:
            self.client_w.close()
        if self.server_w is not None:
            self.server_w.close()
        self.proxy._links.discard(self)


class FaultProxy:
    """See the module doc. ``FaultProxy(target_port)`` listens on a free local port at once; ``close()`` it."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target_host, self.target_port = target_host, target_port
        self.delay_s = 0.0
        self.accepted = 0
        self._dark_new = False
        self._refusing = False
        self._links: set[_Link] = set()
        self._accepting: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_quiet_cancellations)
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._server: asyncio.Server = self._call(self._listen())
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def links(self) -> int:
        return self._call(self._count())

    def latency(self, seconds: float) -> None:
        self.delay_s = seconds

    def dark(self, *, new_too: bool = True, sent: bytes | None = None) -> None:
        """See the module doc; ``sent``: only the open links whose client sent these bytes (``b"SUBSCRIBE"``: the
        pub/sub connections), and no new one."""
        self._call(self._set_dark(new_too and sent is None, sent))

    def heal(self) -> None:
        self._call(self._heal())

    def reset(self) -> None:
        self._call(self._reset())

    def refuse(self) -> None:
        self._refusing = True
        self.reset()

    def retarget(self, port: int, host: str = "127.0.0.1") -> None:
        self.target_host, self.target_port = host, port
        self.reset()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    # -- on the proxy's loop -------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)
        self.accepted += 1
        link = _Link(self, (reader, writer))
        if self._refusing:
            link.abort()
            return
        if self._dark_new:
            link.flowing.clear()
        self._links.add(link)
        await link.run()

    async def _count(self) -> int:
        return len(self._links)

    async def _set_dark(self, new_too: bool, sent: bytes | None) -> None:
        self._dark_new = new_too
        for link in self._links:
            if sent is None or sent in link.sent:
                link.flowing.clear()

    async def _heal(self) -> None:
        self._dark_new = False
        self._refusing = False
        for link in self._links:
            link.flowing.set()

    async def _reset(self) -> None:
        for link in list(self._links):
            link.abort()

    async def _close(self) -> None:
        self._server.close()
        await self._reset()
        for task in list(self._accepting):
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)


def _quiet_cancellations(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A link's task cancelled at close is no news (asyncio's stream callback reports it as an error)."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)
