"""``python3 -m bench.direct_app --port P --tokens-per-s 20``: the naive design rsb replaces.

The engine runs inside the HTTP process and each request streams SSE straight from it: no Redis, no
resume, no second process. Same ``PacedEngine``, run by the rsb worker's own producer into the same hand-off
(``generator.handoff.produce``, ``TokenHandoff``: on the loop, or in a thread per generation with
``--threaded``), so the difference in CPU is the broker's.
``GET /idle`` holds an SSE response open with heartbeats only (the reference of the capacity scenario).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.paced_engine import PacedEngine
from bench.procs import raise_nofile
from broker import runtime
from broker.request.generation import RequestLimits, parse_create_body
from generator.handoff import TokenHandoff, produce

HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def build_app(tokens_per_s: float, heartbeat_s: float, *, threaded: bool = False) -> Starlette:
    engine = PacedEngine(tokens_per_s, on_loop=not threaded)

    async def stream(request: Request) -> Response:
        max_tokens = int(request.query_params.get("max_tokens", "100"))
        _, req = parse_create_body(orjson.dumps({"prompt": "x", "max_tokens": max_tokens}),
                                   RequestLimits(max_tokens=1 << 20, default_max_tokens=max_tokens))

        async def events():  # type: ignore[no-untyped-def]
            loop = asyncio.get_running_loop()
            handoff = TokenHandoff(loop, 256)
            stop = threading.Event()
            # The worker's own producer: the same engine path (on the loop, or a thread with --threaded).
            producer = produce(engine, req, handoff, prefix_text="", max_tokens=max_tokens, stop=stop)
            n = 0
            try:
                while True:
                    batch = await handoff.get(timeout_s=1.0)
                    if batch.pieces:
                        n += 1
                        # The paced engine's pieces are all text (no marker).
                        data = orjson.dumps({"text": "".join(p for p in batch.pieces if isinstance(p, str))})
                        yield b"id: %d\nevent: delta\ndata: %s\n\n" % (n, data)
                    if batch.closed:
                        break
                yield b'id: %d\nevent: done\ndata: {"finish_reason":"length"}\n\n' % (n + 1)
            finally:
                stop.set()
                handoff.abandon()
                if engine.on_loop:
                    producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream", headers=HEADERS)

    async def idle(request: Request) -> Response:
        async def beats():  # type: ignore[no-untyped-def]
            yield b": open\n\n"
            while True:
                await asyncio.sleep(heartbeat_s)
                yield b": keep-alive\n\n"

        return StreamingResponse(beats(), media_type="text/event-stream", headers=HEADERS)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "t": time.time()})

    return Starlette(routes=[Route("/stream", stream), Route("/idle", idle), Route("/healthz", healthz)])


def main() -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.direct_app", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens-per-s", type=float, default=20.0)
    p.add_argument("--heartbeat-s", type=float, default=15.0)
    p.add_argument("--threaded", action="store_true", help="the paced engine in a thread per generation")
    args = p.parse_args()
    raise_nofile()
    import concurrent.futures

    async def run() -> None:
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2048))
        app = build_app(args.tokens_per_s, args.heartbeat_s, threaded=args.threaded)
        config = uvicorn.Config(app, host="127.0.0.1", port=args.port,
                                log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        await uvicorn.Server(config).serve()

    runtime.run(run())


if __name__ == "__main__":
    main()
