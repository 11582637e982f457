"""The servers one upstream engine drives (``--upstream`` given several times, or comma-separated): one model,
served by several replicas. Each generation goes to a healthy one, the least busy; a server is checked every
HEALTH_INTERVAL_S (its model list: the one route every kind has), marked down when a check or a request fails to
reach it, and up again when a check answers. A server that is down is tried only when none is up (it may be back
before its next check says so)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx

from generator.engines.upstream.kinds import KINDS, OLLAMA_KIND, OPENAI_KIND, UpstreamKind, kind_of_listing
from generator.engines.upstream.ollama import OLLAMA
from generator.engines.upstream.protocol import UpstreamProtocol

log = logging.getLogger("rsb.generator")

HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 2.0


def detect_kind(url: str, api: str | None = None) -> UpstreamKind | None:
    """The kind ``api`` names; else Ollama's for a URL whose path ends in ``/api``; else None: an OpenAI-compatible
    server, whose model list says what it is (``Server.check``)."""
    if api:
        kind = KINDS.get(api)
        if kind is None:
            raise ValueError(f"unknown upstream API {api!r}: use one of {', '.join(KINDS)}")
        return kind
    if httpx.URL(url).path.rstrip("/").endswith(OLLAMA.root_suffix):
        return OLLAMA_KIND
    return None


@dataclass(slots=True)
class Server:
    """One server of the pool. ``kind`` is None until its model list said what it is (requests go as ``openai``
    meanwhile: OpenAI's own fields only)."""

    base_url: str
    protocol: UpstreamProtocol
    kind: UpstreamKind | None
    up: bool = True
    #: Requests in flight to it now.
    busy: int = 0
    #: False once it refused vLLM's ``priority`` (no priority scheduling): never sent again.
    takes_priority: bool = True

    @property
    def fields_of(self) -> UpstreamKind:
        return self.kind or OPENAI_KIND


class Pool:
    def __init__(self, urls: Sequence[str], api: str | None, client: Callable[[], httpx.AsyncClient],
                 on_listing: Callable[[object], None]) -> None:
        if not urls:
            raise ValueError("no --upstream URL")
        self.servers: list[Server] = []
        for url in urls:
            kind = detect_kind(url, api)
            protocol = kind.protocol if kind is not None else OPENAI_KIND.protocol
            self.servers.append(Server(protocol.base_url(url), protocol, kind))
        if len({s.protocol.name for s in self.servers}) > 1:
            raise ValueError("the --upstream servers of one generator speak one protocol (all Ollama's, or none)")
        self._client = client
        self._on_listing = on_listing
        self._turn = itertools.count()
        self._watch: asyncio.Task[None] | None = None

    @property
    def protocol(self) -> UpstreamProtocol:
        return self.servers[0].protocol

    def choices(self) -> Iterator[Server]:
        """The servers to try for one generation, in order: those up, the least busy first (in turn among equals),
        then those down."""
        self._start_watching()
        turn = next(self._turn)
        n = len(self.servers)
        order = sorted(range(n), key=lambda i: (not self.servers[i].up, self.servers[i].busy, (i - turn) % n))
        return (self.servers[i] for i in order)

    def others_up(self, server: Server) -> bool:
        return any(s.up for s in self.servers if s is not server)

    def down(self, server: Server, why: str) -> None:
        if server.up:
            log.warning("upstream down: %s", why, extra={"upstream": server.base_url})
        server.up = False

    async def check(self, server: Server) -> bool:
        """Ask ``server`` for its model list: up when it answers (and, an OpenAI-compatible server not identified
        yet, what its list says it is), down when it cannot be reached or fails."""
        try:
            r = await self._client().get(server.base_url + server.protocol.models_path, timeout=HEALTH_TIMEOUT_S)
            r.raise_for_status()
            listing = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.down(server, f"health check: {type(e).__name__}: {e}")
            return False
        if not server.up:
            log.info("upstream up again", extra={"upstream": server.base_url})
        server.up = True
        if server.kind is None:
            server.kind = kind_of_listing(listing) or OPENAI_KIND
            log.info("upstream kind", extra={"upstream": server.base_url, "kind": server.kind.name})
        with contextlib.suppress(AttributeError, TypeError, IndexError):
            self._on_listing(listing)
        return True

    def _start_watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watching(), name="upstream-health")

    async def _watching(self) -> None:
        while True:
            await asyncio.gather(*(self.check(s) for s in self.servers))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
