"""consumer.streaming.sse: an open reader learns that its client left from the connection itself.

A real uvicorn server with the consumer's guarded protocol, in this process, so the test can count the tasks
an open reader holds and see the response end when its client goes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from consumer.edge.guards import Guards, guarded
from consumer.streaming.sse import Drain, SSEResponse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _App:
    """Every request: an SSE response that sends one frame, then waits (no heartbeat within the test)."""

    def __init__(self) -> None:
        self.open = 0
        self.closed = asyncio.Event()
        self.shutdown = Drain()

    async def frames(self) -> AsyncIterator[bytes | None]:
        yield b"event: hello\ndata: {}\n\n"
        await asyncio.sleep(3600)  # a stream with nothing more to say for the whole test
        yield None

    def on_close(self) -> None:
        self.open -= 1
        if self.open == 0:
            self.closed.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.open += 1
        await SSEResponse(self.frames(), shutdown=self.shutdown, send_timeout_s=60,
                          on_close=self.on_close)(scope, receive, send)


async def _server(app: _App, protocol: type[asyncio.Protocol]) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers no event for it)
        await asyncio.sleep(0.01)
    return server, task, port


async def _open_readers(port: int, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    conns = []
    for _ in range(n):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /events HTTP/1.1\r\nHost: localhost\r\n\r\n")
        conns.append((r, w))
    for r, _ in conns:
        got = b""
        while b"event: hello" not in got:
            got += await asyncio.wait_for(r.read(4096), 5)
    return conns


@pytest.mark.parametrize("watched", [True, False], ids=["guarded protocol", "plain uvicorn"])
async def test_an_open_reader_holds_no_disconnect_task_and_still_sees_its_client_leave(watched: bool) -> None:
    app = _App()
    guards = Guards.derive(head_timeout_s=10, body_timeout_s=10, per_address=0, max_connections=0, trusted=(),
                           fd_limit=4096)
    protocol = guarded(AutoHTTPProtocol, guards) if watched else AutoHTTPProtocol
    server, serving, port = await _server(app, protocol)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        # The tasks made since, not a difference of counts: on a busy machine a task of the server's start may
        # still be running when ``before`` is taken and end meanwhile (17 of 20 counted, beside `bench latency`).
        before = asyncio.all_tasks()
        conns = await _open_readers(port, 20)
        tasks_per_reader = len(asyncio.all_tasks() - before) / 20
        # uvicorn runs each request in a task of its own; plain uvicorn's receive needs a second one to wait in.
        assert tasks_per_reader == (1 if watched else 2)
        for _, w in conns:
            w.close()
        # Each response ends (on_close) once its client left: nothing is left holding the stream.
        await asyncio.wait_for(app.closed.wait(), 5)
        assert app.open == 0
    finally:
        for _, w in conns:
            w.close()
        server.should_exit = server.force_exit = True
        await serving
