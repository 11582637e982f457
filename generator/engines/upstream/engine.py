"""The upstream engine: drives a remote inference server over streaming HTTP instead of a local model,
in one of the protocols of this package (``openai``, ``ollama``: see their modules, and
``generator.engines.upstream.protocol`` for what they share).

Cancelling. Setting ``stop`` shuts the upstream socket down at once, from a watcher thread, even while the
inference thread is blocked waiting for the server (a long prefill, a queue in front of the model), so the
server sees the client disconnect and stops computing.

``request.model`` is ignored, like the local engine ignores it: a generator serves one model, chosen with
``--upstream-model`` (or the first one the server lists).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from broker.request import GenerationRequest
from generator.engines.base import Engine, Generation, UpstreamError
from generator.engines.upstream.ollama import OLLAMA
from generator.engines.upstream.openai import OPENAI
from generator.engines.upstream.protocol import UpstreamGeneration, UpstreamProtocol, error_message, stream_pieces

log = logging.getLogger("rsb.generator")

PROTOCOLS: dict[str, UpstreamProtocol] = {p.name: p for p in (OPENAI, OLLAMA)}

# Bytes of an upstream error body kept for the stream's `error` message.
_ERROR_BODY_LIMIT = 2048


def detect_api(url: str, api: str | None = None) -> UpstreamProtocol:
    """The protocol: ``api`` when given, else ``ollama`` for a URL whose path ends in ``/api``, else ``openai``."""
    if api:
        protocol = PROTOCOLS.get(api)
        if protocol is None:
            raise ValueError(f"unknown upstream API {api!r}: use one of {', '.join(PROTOCOLS)}")
        return protocol
    return OLLAMA if urlsplit(url).path.rstrip("/").endswith(OLLAMA.root_suffix) else OPENAI


class _Aborter:
    """Shuts the upstream connection's socket down when ``stop`` is set. shutdown() (not close()) is what
    wakes a thread blocked in recv() on the socket, and it sends the server a FIN, so it sees the client
    leave. The socket is learnt from httpcore's connection trace, before any byte of the answer."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._fired = False
        self._finished = threading.Event()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._sock = sock
            fired = self._fired
        if fired or self._stop.is_set():
            self.fire()

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: the request is over anyway

    @property
    def fired(self) -> bool:
        return self._fired

    def watch(self) -> None:
        """Start the watcher thread; it ends when the generation does (``finish``) or after firing."""
        threading.Thread(target=self._watch, name="rsb-upstream-abort", daemon=True).start()

    def _watch(self) -> None:
        # stop.wait returns as soon as stop is set; the timeout only bounds how long this thread outlives
        # a generation that ended normally.
        while not self._finished.is_set():
            if self._stop.wait(0.25):
                self.fire()
                return

    def finish(self) -> None:
        self._finished.set()


class UpstreamEngine(Engine):
    """``Engine`` over a remote server. Generations are independent HTTP requests, so any number run at
    once (the worker's ``--concurrency``); each is driven by sync httpx in its own inference thread."""

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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No keep-alive: a connection is never shared, so shutting one down on cancel hurts no other
        # generation, and the trace always sees the connect. A handshake per generation costs nothing
        # next to the generation itself.
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self._model = model
        self._discovered = model is not None
        self.name: str = model or f"upstream@{urlsplit(self.base_url).netloc}"
        if model is None:
            self._discover_model()

    def _discover_model(self) -> None:
        """Without ``--upstream-model``, use the first model the server lists. Failure is not fatal (the
        server may start later); it is tried again before each generation until it succeeds."""
        try:
            r = self._client.get(self.base_url + self.protocol.models_path, timeout=5.0)
            r.raise_for_status()
            first = self.protocol.first_model(r.json())
        except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError) as e:
            log.warning("could not list the upstream's models: %s", e, extra={"upstream": self.base_url})
            return
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
    ) -> Generation:
        generation = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
        generation.pieces = self._run(generation, request, prefix_text, max_tokens, stop)
        return generation

    def _run(self, generation: UpstreamGeneration, request: GenerationRequest, prefix_text: str,
             max_tokens: int, stop: threading.Event) -> Iterator[str]:
        if stop.is_set():
            return
        if max_tokens <= 0:  # nothing left to generate; servers refuse max_tokens=0
            generation.finish_reason = "length"
            return
        if not self._discovered:
            self._discover_model()
        call = self.protocol.build_request(request, prefix_text=prefix_text, max_tokens=max_tokens,
                                           model=self._model, ignore_eos=self.ignore_eos)
        aborter = _Aborter(stop)
        aborter.watch()
        try:
            with self._client.stream("POST", self.base_url + call.path, json=call.body,
                                     extensions={"trace": aborter.trace}) as response:
                if response.status_code >= 400:
                    raise UpstreamError(self._http_error(response))
                chunks = self.protocol.chunks(response.iter_lines(), chat=call.chat)
                yield from stream_pieces(chunks, generation=generation, max_tokens=max_tokens, stop=stop)
        except httpx.HTTPError as e:
            if stop.is_set() or aborter.fired:
                return  # our own abort: the caller knows why the generation stopped
            if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                raise UpstreamError(f"upstream unreachable at {self.base_url}: {e}") from e
            raise UpstreamError(f"upstream request failed: {type(e).__name__}: {e}") from e
        finally:
            aborter.finish()

    @staticmethod
    def _http_error(response: httpx.Response) -> str:
        raw = b""
        for part in response.iter_bytes():
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
        self._client.close()
