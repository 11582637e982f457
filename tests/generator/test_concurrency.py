"""``rsb generator --concurrency N`` runs N generations at once, whatever the machine: each threaded
generation has an inference thread of its own (generator.handoff.produce), not one of asyncio's default
executor, whose ``min(32, cores + 4)`` threads (6 on two cores) held the others back, claimed and silent
after their ``started`` until another generation ended.

The upstream here is a scripted OpenAI-compatible server, slow on purpose (a token every 0.1 s) and serving
any number of requests at once, as vLLM does; llama-cpp-python's server runs one request at a time."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis
from helpers import SSE, create, sse_blocks, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow

TOKEN_PERIOD_S = 0.1
TOKENS = 200  # 20 s an answer: far longer than the test waits, so no generation ends and frees its slot
CONCURRENCY = 12


class _SlowCompletions(BaseHTTPRequestHandler):
    """``GET /v1/models`` and a streamed ``POST /v1/completions``: one token per TOKEN_PERIOD_S. HTTP/1.0: the
    body ends when the connection closes."""

    protocol_version = "HTTP/1.0"
    open_streams = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        with self.lock:
            type(self).open_streams += 1
        try:
            for i in range(TOKENS):
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(TOKEN_PERIOD_S)  # an upstream as slow as a real one
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
                             b"data: [DONE]\n\n")
        except OSError:
            pass  # the generator left (a cancel)
        finally:
            with self.lock:
                type(self).open_streams -= 1

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def slow_upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowCompletions)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _first_delta(c: httpx.Client, sid: str, deadline: float) -> bool:
    """Whether the stream has a ``delta`` before ``deadline`` (the read stops at the first one)."""
    timeout = max(0.1, deadline - time.monotonic())
    try:
        with c.stream("GET", f"/v1/streams/{sid}/events", timeout=httpx.Timeout(timeout)) as r:
            for parsed in sse_blocks(r):
                if isinstance(parsed, SSE) and parsed.event == "delta":
                    return True
                if time.monotonic() > deadline:
                    return False
    except httpx.ReadTimeout:
        return False
    return False


def test_concurrency_twelve_streams_twelve_generations_at_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_upstream: str) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--upstream", slow_upstream, "--concurrency", str(CONCURRENCY), ignore_eos=False)
    with s.client() as c:
        sids = [create(c, prompt="count", max_tokens=TOKENS).json()["id"] for _ in range(CONCURRENCY)]
        deadline = time.monotonic() + 8.0
        try:
            streaming = [sid for sid in sids if _first_delta(c, sid, deadline)]
            assert len(streaming) == CONCURRENCY, (
                f"{len(streaming)} of {CONCURRENCY} generations streaming; upstream requests open: "
                f"{_SlowCompletions.open_streams}")
        finally:
            for sid in sids:
                c.post(f"/v1/streams/{sid}/cancel")
        for sid in sids:
            assert wait_status(c, sid, {"cancelled", "done"}, timeout_s=30)["status"] == "cancelled"
