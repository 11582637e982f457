"""Running the consumer under uvicorn, with a shutdown that does not wait on open SSE streams and the
connection guards of consumer.edge.guards (head and body timeouts, connections per address and per pod, the
write-stall guard that drops connections whose client stopped reading)."""

from __future__ import annotations

import ipaddress
import logging
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from broker import runtime, telemetry
from broker.redis.eviction import check_eviction_policy
from consumer.app import create_app
from consumer.edge.guards import Guards, guarded, open_file_limit, stall_guarded
from consumer.settings import ConsumerSettings
from consumer.streaming.sse import Drain

log = logging.getLogger("rsb.consumer")


class ConsumerServer(uvicorn.Server):
    """uvicorn waits for open connections before exiting, and an SSE response never closes on its own.
    On SIGTERM/SIGINT we also set ``draining``, so every open stream ends at an event boundary."""

    def __init__(self, config: uvicorn.Config, draining: Drain) -> None:
        super().__init__(config)
        self.draining = draining

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.draining.is_set():
            log.info("draining: no new connections; open streams told to reconnect elsewhere")
        self.draining.set()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown, which kills the process before `rsb up`
        # can stop its generators and Redis server. A drained exit is a clean exit: status 0.
        self._captured_signals.clear()


def who_can_reach(host: str, port: int) -> str:
    """Who can reach a server listening on ``host``, in words, for the warning of an open API."""
    if host in ("", "0.0.0.0", "::"):
        return f"anyone who can reach port {port} of this machine (it listens on every interface)"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "programs on this machine only (it listens on loopback)"
    except ValueError:
        if host == "localhost":
            return "programs on this machine only (it listens on loopback)"
    return f"anyone who can reach {host}:{port}"


def build_server(settings: ConsumerSettings, *, expect_model: bool = False, **uvicorn_options: Any) -> ConsumerServer:
    """``expect_model``: see consumer.app.create_app."""
    draining = Drain()
    app = create_app(settings, draining=draining, expect_model=expect_model)
    guards = Guards.derive(head_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                           per_address=settings.max_connections_per_ip, max_connections=settings.max_connections,
                           trusted=settings.forwarded_allow_ips, fd_limit=open_file_limit())
    uvicorn_options.setdefault("http", stall_guarded(guarded(AutoHTTPProtocol, guards), settings.send_timeout_s))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        lifespan="on",
        timeout_keep_alive=settings.keep_alive_s,
        # The client address every per-address limit counts: X-Forwarded-For, from these peers only.
        proxy_headers=True,
        forwarded_allow_ips=list(settings.forwarded_allow_ips),
        ws="none",  # no route speaks WebSocket: an upgrade request is an ordinary (refused) request
        **uvicorn_options,
    )
    if not settings.api_keys_file:
        log.warning("no API keys (--api-keys FILE): the API is open, without authentication, to %s; each "
                    "client address gets the per-address limits (docs/security.md)",
                    who_can_reach(settings.host, settings.port))
    log.info("connection limits", extra={"max_connections": guards.total, "closed_above": guards.hard_total,
                                         "per_address": guards.per_address, "head_timeout_s": guards.head_timeout_s,
                                         "trusted_proxies": ",".join(settings.forwarded_allow_ips)})
    return ConsumerServer(config, draining)


def run_consumer(settings: ConsumerSettings) -> None:
    # allkeys-* could evict unfinished streams: refused before serving (EvictionPolicyRefused, said by rsb.cli).
    check_eviction_policy(settings.broker.url, cluster=settings.broker.cluster, role="rsb consumer")
    tracing = telemetry.setup("rsb-consumer")  # before the app is built: it wraps it (TelemetryMissing: rsb.cli)
    try:
        server = build_server(settings)
        runtime.tune_gc()
        log.info("consumer listening", extra={"url": f"http://{settings.host}:{settings.port}",
                                              "stack": runtime.stack()})
        server.run()
    finally:
        tracing.shutdown()
