"""The upstream engine: drives remote inference servers over streaming HTTP instead of a local model, in one of
the protocols of this package (``openai``, ``ollama``: see their modules, and
``generator.engines.upstream.protocol`` for what they share), with what each kind of server takes beyond it
(``generator.engines.upstream.kinds``), over a pool of servers of one model (``generator.engines.upstream.pool``).

It produces on the event loop (``on_loop``): a generation is one ``httpx.AsyncClient`` request, so a worker
runs hundreds at once with no thread each. Cancelling. The worker cancels the producing task as soon as
``stop`` is set (generator.handoff), even while the request waits for the server (a long prefill, a queue in
front of the model); cancelling closes the request's connection, so the server sees the client leave and
stops computing.

Several servers. A generation goes to the least busy server that is up; one that cannot be reached (or answers
502/503/504) before the answer began is marked down and the next one is tried at once. A server that dies midway
(its stream cut, its connection broken) is marked down too, and when another is up the generation is *lost*
(GenerationLost): its run hands the job over, and the next claim continues it from the stream on a server that is
up, exactly as a crashed worker's is. With no other server up, it ends with error ``upstream`` as before.

``request.model`` is ignored, like the local engine ignores it: a generator serves one model, chosen with
``--upstream-model`` (or the first one the server lists).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import httpx

from broker.request.generation import GenerationRequest, prompt_token_bound
from generator.engines.base import Engine, Generation, GenerationLost, UpstreamCut, UpstreamError
from generator.engines.pieces import PartialAnswer, Piece
from generator.engines.upstream.ollama import OLLAMA
from generator.engines.upstream.openai import OPENAI
from generator.engines.upstream.pool import Pool, Server, detect_kind
from generator.engines.upstream.protocol import (
    LineReader,
    Replay,
    UpstreamGeneration,
    UpstreamPieces,
    UpstreamProtocol,
    UpstreamRequest,
    error_message,
    replays,
)
from generator.telemetry import end_upstream, upstream_headers, upstream_span

log = logging.getLogger("rsb.generator")

PROTOCOLS: dict[str, UpstreamProtocol] = {p.name: p for p in (OPENAI, OLLAMA)}

# Bytes of an upstream error body kept for the stream's `error` message.
_ERROR_BODY_LIMIT = 2048
# After the last piece kept (the budget spent), how much more of the upstream's stream is read for its usage
# record: vLLM, OpenAI and llama.cpp's server send it after the finish chunk. A server asked for that budget
# ends at once; one that ignores it is cut after these, and the prompt is counted by its bound.
USAGE_TAIL_RECORDS = 16
USAGE_TAIL_S = 5.0
#: Answers of a server that is there but cannot serve now (a proxy in front of a dead one, an overloaded one):
#: before the answer began, the next server is tried.
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
#: What a request whose connection failed or broke raised: the server (or the network to it) is gone.
GONE_ERRORS = (httpx.TransportError,)


class UpstreamPromptTooLong(UpstreamError):
    """The upstream refused the prompt as longer than its model's context."""

    code = "context_length_exceeded"


def detect_api(url: str, api: str | None = None) -> UpstreamProtocol:
    """The protocol: the one of the kind ``api`` names, else ``ollama`` for a URL whose path ends in ``/api``, else
    ``openai``."""
    kind = detect_kind(url, api)
    return kind.protocol if kind is not None else OPENAI


class UpstreamEngine(Engine):
    """``Engine`` over remote servers of one model. Generations are independent HTTP requests, so any number
    run at once (the worker's ``--concurrency``), each a task on the worker's event loop."""

    on_loop = True

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        api: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        ignore_eos: bool = False,
        keep_alive: str = "",
    ) -> None:
        self.pool = Pool([urls] if isinstance(urls, str) else list(urls), api, self._client_for_loop, self._listed)
        self.protocol = self.pool.protocol
        self.base_url = self.pool.servers[0].base_url
        self.ignore_eos = ignore_eos
        self.keep_alive = keep_alive
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        # Made on first use, on the worker's loop (an AsyncClient belongs to the loop it first ran on).
        self._client: httpx.AsyncClient | None = None
        self._model = model
        self._discovered = model is not None
        self.name: str = model or f"upstream@{urlsplit(self.base_url).netloc}"
        if model is None:
            self._discover_model()

    def _client_for_loop(self) -> httpx.AsyncClient:
        if self._client is None:
            # A connection cancelled mid-answer is closed, never returned to the pool, so keep-alive is safe.
            self._client = httpx.AsyncClient(headers=self._headers, timeout=self._timeout,
                                             limits=httpx.Limits(max_connections=None))
        return self._client

    def _discover_model(self) -> None:
        """Without ``--upstream-model``, use the first model the server lists. Failure is not fatal (the
        server may start later); it is tried again before each generation until it succeeds. At start this
        is one blocking request (the worker's loop is not serving yet)."""
        for server in self.pool.servers:
            try:
                r = httpx.get(server.base_url + self.protocol.models_path, headers=self._headers, timeout=5.0)
                r.raise_for_status()
                self._listed(r.json())
                return
            except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError) as e:
                log.warning("could not list the upstream's models: %s", e, extra={"upstream": server.base_url})

    def _listed(self, listing: object) -> None:
        if self._discovered:
            return
        first = self.protocol.first_model(listing)
        self._discovered = True
        if first is not None:
            self._model = first
            self.name = first
            log.info("upstream model", extra={"upstream": self.base_url, "model": first})

    def start(
        self,
        request: GenerationRequest,
        *,
        prefix_text: str,
        max_tokens: int,
        stop: threading.Event,
        partial: PartialAnswer | None = None,
        cache_scope: str = "",
        tier: str = "",
    ) -> Generation:
        generation = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
        generation.apieces = self._run(generation, request, prefix_text, max_tokens, stop, partial, cache_scope, tier)
        return generation

    async def _run(self, generation: UpstreamGeneration, request: GenerationRequest, prefix_text: str,
                   max_tokens: int, stop: threading.Event, partial: PartialAnswer | None,
                   cache_scope: str, tier: str) -> AsyncIterator[Piece]:
        if stop.is_set():
            return
        if max_tokens <= 0:  # nothing left to generate; servers refuse max_tokens=0
            generation.finish_reason = "length"
            return
        replay = None
        ask_tokens = max_tokens
        if replays(request, prefix_text, partial):
            # Asked again as first asked (the whole budget), the stored part checked and skipped.
            replay = Replay(prefix_text, partial)
            prefix_text = ""
            ask_tokens = request.max_tokens
        failed: UpstreamError | None = None
        for server in self.pool.choices():
            if server.kind is None or not self._discovered:
                await self.pool.check(server)  # what it is (the fields it takes), and the model's name
            call = self.protocol.build_request(request, prefix_text=prefix_text, max_tokens=ask_tokens,
                                               model=self._model, cache_scope=cache_scope)
            pieces = UpstreamPieces(generation=generation, max_tokens=max_tokens, stop=stop, replay=replay)
            server.busy += 1
            try:
                async for piece in self._request(server, call, pieces, request, cache_scope, tier):
                    yield piece
                return
            except _Unreachable as e:  # nothing was answered: the next server
                self.pool.down(server, str(e))
                failed = UpstreamError(f"upstream unreachable at {server.base_url}: {e}")
            except (*GONE_ERRORS, UpstreamCut) as e:
                if stop.is_set():
                    return  # our own abort: the caller knows why the generation stopped
                self.pool.down(server, f"{type(e).__name__}: {e}")
                if self.pool.others_up(server):
                    raise GenerationLost(f"upstream {server.base_url} failed mid-answer ({type(e).__name__}); "
                                         "continued on another") from e
                if isinstance(e, UpstreamError):
                    raise
                raise UpstreamError(f"upstream request failed: {type(e).__name__}: {e}") from e
            except httpx.HTTPError as e:
                if stop.is_set():
                    return
                raise UpstreamError(f"upstream request failed: {type(e).__name__}: {e}") from e
            finally:
                server.busy -= 1
        assert failed is not None
        raise failed

    async def _request(self, server: Server, call: UpstreamRequest, pieces: UpstreamPieces,
                       request: GenerationRequest, cache_scope: str, tier: str) -> AsyncIterator[Piece]:
        """One request to ``server``, streamed into pieces. Raises _Unreachable when nothing was answered."""
        generation = pieces.generation
        reader = self.protocol.reader(chat=call.chat)
        kind = server.fields_of
        span = upstream_span(self.protocol.name, server.base_url, self._model, chat=call.chat)  # None: not traced
        status: int | None = None
        try:
            while True:
                sent = {**call.body, **kind.fields(cache_scope=cache_scope, tier=tier, ignore_eos=self.ignore_eos,
                                                   keep_alive=self.keep_alive, priority=server.takes_priority)}
                try:
                    async with self._client_for_loop().stream("POST", server.base_url + call.path, json=sent,
                                                              headers=upstream_headers(span)) as response:
                        status = response.status_code
                        if response.status_code in UNAVAILABLE_STATUSES:
                            raise _Unreachable(f"HTTP {response.status_code}")
                        if response.status_code >= 400:
                            message = await self._http_error(response)
                            if "priority" in sent and "priority scheduling" in message.lower():
                                # A vLLM without --scheduling-policy priority: the field never again; the request again.
                                log.warning("the upstream has no priority scheduling: its jobs are sent no priority",
                                            extra={"upstream": server.base_url})
                                server.takes_priority = False
                                continue
                            if response.status_code == 400 and _context_exceeded(message):
                                raise UpstreamPromptTooLong(message)
                            raise UpstreamError(message)
                        # The upstream took the prompt. Until it reports its count, the prompt's bound: a generation
                        # cut before the usage record (cancelled, or a server that reports none) is charged that.
                        generation.prompt_tokens = prompt_token_bound(request.canonical_json())
                        lines = response.aiter_lines()
                        async for line in lines:
                            chunk = reader.feed(line)
                            if chunk is None:
                                continue
                            for piece in pieces.feed(chunk):
                                yield piece
                            if pieces.over:
                                break
                        if pieces.awaits_usage:
                            await _read_usage(lines, reader, pieces)
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    raise _Unreachable(f"{type(e).__name__}: {e}") from e
                for piece in pieces.end():
                    yield piece
                return
        finally:
            end_upstream(span, status, sys.exc_info()[1])

    @staticmethod
    async def _http_error(response: httpx.Response) -> str:
        raw = b""
        async for part in response.aiter_bytes():
            raw += part
            if len(raw) >= _ERROR_BODY_LIMIT:
                break
        text = raw[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
        try:
            obj = json.loads(text)
            if isinstance(obj, dict) and "error" in obj:
                text = error_message(obj["error"])
            elif isinstance(obj, dict) and "detail" in obj:  # FastAPI-based servers
                text = str(obj["detail"])
            elif isinstance(obj, dict) and "message" in obj:  # vLLM's own error object
                text = str(obj["message"])
        except ValueError:
            pass
        return f"upstream answered HTTP {response.status_code}: {text or response.reason_phrase}"

    def close(self) -> None:
        """The worker closes its engine as it exits, when no generation is in flight: the pool's idle
        keep-alive connections are left to close with the process (``close`` is synchronous; an
        AsyncClient closes by awaiting)."""
        self.pool.close()
        self._client = None


class _Unreachable(Exception):
    """A server that answered nothing (connection refused or timed out, or a 502/503/504 from in front of it)."""


#: How servers say a prompt is past the model's context: OpenAI's code, vLLM's message, llama.cpp's error type.
_CONTEXT_MARKERS = ("context_length_exceeded", "maximum context length", "exceed_context_size",
                    "exceeds the available context size", "context length")


def _context_exceeded(message: str) -> bool:
    lowered = message.lower()
    return any(m in lowered for m in _CONTEXT_MARKERS)


async def _read_usage(lines: AsyncIterator[str], reader: LineReader, pieces: UpstreamPieces) -> None:
    """The rest of a stream whose answer is over, read for its usage record only (bounded: USAGE_TAIL_*). Text
    past the budget is dropped; an error record there ends nothing (the answer is whole)."""
    records = 0
    with contextlib.suppress(TimeoutError, UpstreamError):
        async with asyncio.timeout(USAGE_TAIL_S):
            async for line in lines:
                chunk = reader.feed(line)
                if chunk is None:
                    continue
                pieces.count(chunk)
                records += 1
                if not pieces.awaits_usage or records >= USAGE_TAIL_RECORDS:
                    return
