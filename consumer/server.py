"""Running the consumer under uvicorn, with a shutdown that does not wait on open SSE streams."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from broker.settings import ConsumerSettings
from consumer.app import create_app

log = logging.getLogger("rsb.consumer")


class ConsumerServer(uvicorn.Server):
    """uvicorn waits for open connections before exiting, and an SSE response never closes on its own.
    On SIGTERM/SIGINT we also set ``draining``, so every open stream ends at an event boundary."""

    def __init__(self, config: uvicorn.Config, draining: asyncio.Event) -> None:
        super().__init__(config)
        self.draining = draining

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.draining.set()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown, which kills the process before `rsb up`
        # can stop its generators and Redis server. A drained exit is a clean exit: status 0.
        self._captured_signals.clear()


def build_server(settings: ConsumerSettings, **uvicorn_options: object) -> ConsumerServer:
    draining = asyncio.Event()
    app = create_app(settings, draining=draining)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        lifespan="on",
        **uvicorn_options,  # type: ignore[arg-type]
    )
    return ConsumerServer(config, draining)


def run_consumer(settings: ConsumerSettings) -> None:
    server = build_server(settings)
    log.info("consumer listening", extra={"url": f"http://{settings.host}:{settings.port}"})
    server.run()
