"""``python3 -m bench.engine_app --port P``: rsb's engine with nothing of the broker around it (issue 43's
attribution: which part of the gap to llama-server is the engine's, which the broker's).

The engine the generator would build from its default settings (``build_engine``: the default model,
``--parallel``, ``--n-ctx``, the prompt cache; any engine flag of ``rsb generator`` changes them), run by the
worker's own producer into the same hand-off (``generator.handoff.produce``, a thread per generation), and
streamed straight out as OpenAI chat-completion chunks from the same process: no Redis, no consumer, no
queue, no second process. Every request is in one cache scope (as ``rsb up``'s one unlimited bench tenant).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from broker import runtime
from broker.request.generation import RequestLimits, parse_create_body
from generator.engines import Generation, build_engine
from generator.handoff import TokenHandoff, produce
from generator.settings import EngineSettings

HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
ALIAS = "rsb-engine"
#: How a results table names this system's command.
COMMAND = "python3 -m bench.engine_app (rsb's default engine, no broker)"


def build_app(settings: EngineSettings) -> Starlette:
    engine = build_engine(settings)
    limits = RequestLimits(max_tokens=1 << 20, default_max_tokens=256)

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        native = {k: body[k] for k in ("messages", "max_tokens", "temperature", "seed") if k in body}
        _, req = parse_create_body(orjson.dumps(native), limits)

        async def events():  # type: ignore[no-untyped-def]
            loop = asyncio.get_running_loop()
            handoff = TokenHandoff(loop, 256)
            stop = threading.Event()
            started: list[Generation] = []
            producer = produce(engine, req, handoff, prefix_text="", max_tokens=req.max_tokens, stop=stop,
                               on_start=started.append)
            tokens = 0
            try:
                while True:
                    batch = await handoff.get(timeout_s=1.0)
                    text = "".join(p for p in batch.pieces if isinstance(p, str))
                    tokens += sum(isinstance(p, str) for p in batch.pieces)
                    if text:
                        chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
                        yield b"data: %s\n\n" % orjson.dumps(chunk)
                    if batch.closed:
                        if batch.error is not None:  # cut the body: the load process counts no answer as whole
                            raise batch.error
                        break
                usage: dict[str, object] = {"completion_tokens": tokens}
                if started:  # what the engine evaluated of the prompt, as rsb's views report it
                    usage.update(prompt_tokens=started[0].prompt_tokens,
                                 prompt_tokens_details={"cached_tokens": started[0].cached_tokens})
                last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
                yield b"data: %s\n\ndata: [DONE]\n\n" % orjson.dumps(last)
            finally:
                stop.set()
                handoff.abandon()
                await asyncio.gather(producer, return_exceptions=True)

        return StreamingResponse(events(), media_type="text/event-stream", headers=HEADERS)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": ALIAS, "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])


@contextlib.contextmanager
def serving(*flags: str) -> Iterator[str]:
    """This app (``flags``: engine flags) on a free port, once its engine is loaded: its URL. Stopped on leaving."""
    from bench import procs
    from broker.redis.server import free_port

    port = free_port()
    app = procs.Proc(procs.python_module("bench.engine_app", "--port", str(port), *flags), "engine-app")
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/v1/models", app, 300)
        yield f"http://127.0.0.1:{port}"
    finally:
        app.stop(30)


def main() -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.engine_app", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    args, engine_flags = p.parse_known_args()  # the rest: engine flags (--parallel 1, --prompt-cache-mib 0, ...)
    settings = EngineSettings.from_argv(engine_flags)

    async def run() -> None:
        app = build_app(settings)
        config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1)
        await uvicorn.Server(config).serve()

    runtime.run(run())


if __name__ == "__main__":
    main()
