"""The upstream engine: drives a remote inference server over streaming HTTP instead of a local model,
in one of the protocols of this package (``openai``, ``ollama``: see their modules, and
``generator.engines.upstream.protocol`` for what they share).

It produces on the event loop (``on_loop``): a generation is one ``httpx.AsyncClient`` request, so a worker
runs hundreds at once with no thread each. Cancelling. The worker cancels the producing task as soon as
``stop`` is set (generator.handoff), even while the request waits for the server (a long prefill, a queue in
front of the model); cancelling closes the request's connection, so the server sees the client leave and
stops computing.

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
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

from broker.request import GenerationRequest, prompt_token_bound
from generator.engines.base import Engine, Generation, UpstreamError
from generator.engines.pieces import PartialAnswer, Piece
from generator.engines.upstream.ollama import OLLAMA
from generator.engines.upstream.openai import OPENAI
from generator.engines.upstream.protocol import (
    LineReader,
    Replay,
    UpstreamGeneration,
    UpstreamPieces,
    UpstreamProtocol,
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


def detect_api(url: str, api: str | None = None) -> UpstreamProtocol:
    """The protocol: ``api`` when given, else ``ollama`` for a URL whose path ends in ``/api``, else ``openai``."""
    if api:
        protocol = PROTOCOLS.get(api)
        if protocol is None:
            raise ValueError(f"unknown upstream API {api!r}: use one of {', '.join(PROTOCOLS)}")
        return protocol
    return OLLAMA if urlsplit(url).path.rstrip("/").endswith(OLLAMA.root_suffix) else OPENAI


class UpstreamEngine(Engine):
    """``Engine`` over a remote server. Generations are independent HTTP requests, so any number run at
    once (the worker's ``--concurrency``), each a task on the worker's event loop."""

    on_loop = True

    def __init__(
        self,
        url: str,
        *,
        api: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        ignore_eos: bool = False,
    ) -> None:
        self.protocol = detect_api(url, api)
        self.base_url = self.protocol.base_url(url)
        self.ignore_eos = ignore_eos
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
        try:
            r = httpx.get(self.base_url + self.protocol.models_path, headers=self._headers, timeout=5.0)
            r.raise_for_status()
            self._listed(r.json())
        except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError) as e:
            log.warning("could not list the upstream's models: %s", e, extra={"upstream": self.base_url})

    async def _adiscover_model(self) -> None:
        try:
            r = await self._client_for_loop().get(self.base_url + self.protocol.models_path, timeout=5.0)
            r.raise_for_status()
            self._listed(r.json())
        except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError) as e:
            log.warning("could not list the upstream's models: %s", e, extra={"upstream": self.base_url})

    def _listed(self, listing: object) -> None:
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
    ) -> Generation:
        generation = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
        generation.apieces = self._run(generation, request, prefix_text, max_tokens, stop, partial, cache_scope)
        return generation

    async def _run(self, generation: UpstreamGeneration, request: GenerationRequest, prefix_text: str,
                   max_tokens: int, stop: threading.Event, partial: PartialAnswer | None,
                   cache_scope: str) -> AsyncIterator[Piece]:
        if stop.is_set():
            return
        if max_tokens <= 0:  # nothing left to generate; servers refuse max_tokens=0
            generation.finish_reason = "length"
            return
        if not self._discovered:
            await self._adiscover_model()
        replay = None
        ask_tokens = max_tokens
        if replays(request, prefix_text, partial):
            # Asked again as first asked (the whole budget), the stored part checked and skipped.
            replay = Replay(prefix_text, partial)
            prefix_text = ""
            ask_tokens = request.max_tokens
        call = self.protocol.build_request(request, prefix_text=prefix_text, max_tokens=ask_tokens,
                                           model=self._model, ignore_eos=self.ignore_eos, cache_scope=cache_scope)
        pieces = UpstreamPieces(generation=generation, max_tokens=max_tokens, stop=stop, replay=replay)
        reader = self.protocol.reader(chat=call.chat)
        span = upstream_span(self.protocol.name, self.base_url, self._model, chat=call.chat)  # None: not traced
        status: int | None = None
        try:
            async with self._client_for_loop().stream("POST", self.base_url + call.path, json=call.body,
                                                       headers=upstream_headers(span)) as response:
                status = response.status_code
                if response.status_code >= 400:
                    raise UpstreamError(await self._http_error(response))
                # The upstream took the prompt. Until it reports its count, the prompt's bound: a generation cut
                # before the usage record (cancelled, or a server that reports none) is charged that, never 0.
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
            for piece in pieces.end():
                yield piece
        except httpx.HTTPError as e:
            if stop.is_set():
                return  # our own abort: the caller knows why the generation stopped
            if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                raise UpstreamError(f"upstream unreachable at {self.base_url}: {e}") from e
            raise UpstreamError(f"upstream request failed: {type(e).__name__}: {e}") from e
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
        except ValueError:
            pass
        return f"upstream answered HTTP {response.status_code}: {text or response.reason_phrase}"

    def close(self) -> None:
        """The worker closes its engine as it exits, when no generation is in flight: the pool's idle
        keep-alive connections are left to close with the process (``close`` is synchronous; an
        AsyncClient closes by awaiting)."""
        self._client = None


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
