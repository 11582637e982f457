"""The upstream engine: drives a remote inference server over streaming HTTP instead of a local model.

Two protocols:

- ``openai``: any OpenAI-compatible server (vLLM, llama.cpp's server, llama-cpp-python's server, Ollama's
  ``/v1``, ...). ``messages`` requests go to ``POST /v1/chat/completions``, ``prompt`` requests to
  ``POST /v1/completions``, both with ``stream: true`` (server-sent events) and
  ``stream_options.include_usage`` so servers that can report usage do.
- ``ollama``: Ollama's native API, ``POST /api/chat`` and ``POST /api/generate`` (``raw``, so a prompt is
  completed as given, like the local engine does), streamed as NDJSON.

Pieces. The worker counts one token per piece, so each piece is one upstream delta that carries text.
Servers send about one token per delta, but not exactly: they hold back a token that ends inside a UTF-8
character or might start a stop sequence and send it merged with the next one, and some send empty deltas
that are no token. When the upstream reports usage at the end (``stream_options.include_usage``: vLLM,
llama.cpp's server, OpenAI, Ollama's /v1; ``eval_count``: Ollama's native API), the tokens that came merged
follow as empty pieces, so the worker's count is the upstream's; that count is also kept in
``UpstreamGeneration.completion_tokens``. llama-cpp-python's server reports no usage when streaming: with it
``completion_tokens`` is the number of deltas with text (a few less than the tokens) and ``prompt_tokens``
is 0.

Continuing an answer (``prefix_text``, after a crash). ``prompt`` requests are exact: the prefix is appended
to the prompt, as the local engine does. Chat APIs offer no portable way to make the model continue its own
partial message, so ``messages`` requests get the partial answer as an assistant message followed by a user
message asking to continue it without repeating anything. The model usually complies, but the seam is not
guaranteed to be exact (a repeated word, a missing space).

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from broker.request import GenerationRequest
from generator.engine import Generation

log = logging.getLogger("rsb.generator")

API_OPENAI = "openai"
API_OLLAMA = "ollama"
APIS = (API_OPENAI, API_OLLAMA)

#: Sent (as a user message) after the partial answer when a chat generation is continued after a crash.
CONTINUE_INSTRUCTION = (
    "Continue your previous reply from exactly where it stopped. Output only the continuation: "
    "no preamble, and do not repeat any text you already wrote."
)

# Bytes of an upstream error body kept for the stream's `error` message.
_ERROR_BODY_LIMIT = 2048


class UpstreamError(RuntimeError):
    """The upstream failed: unreachable, an HTTP error, an error event, or a stream cut mid-answer."""

    #: The stream's ``error`` event code (the worker reads ``code`` off engine exceptions).
    code = "upstream"


@dataclass(slots=True)
class UpstreamGeneration(Generation):
    """A Generation that also keeps the upstream's own count of generated tokens, when it reports one."""

    completion_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one upstream stream record means: a piece of text (None: not a token), an end, a usage."""

    piece: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False


def detect_api(url: str, api: str | None = None) -> str:
    """The protocol: ``api`` when given, else ``ollama`` for a URL whose path ends in ``/api``, else ``openai``."""
    if api:
        if api not in APIS:
            raise ValueError(f"unknown upstream API {api!r}: use one of {', '.join(APIS)}")
        return api
    return API_OLLAMA if urlsplit(url).path.rstrip("/").endswith("/api") else API_OPENAI


def base_url(url: str, api: str) -> str:
    """The server root: users paste ``http://host:8000/v1`` or ``http://host:11434/api`` as often as the root."""
    root = url.rstrip("/")
    suffix = "/v1" if api == API_OPENAI else "/api"
    if root.endswith(suffix):
        root = root[: -len(suffix)]
    return root


def map_finish_reason(raw: str | None) -> str:
    """The contract knows only stop and length; anything else (eos, content_filter, tool_calls) ended the
    answer on the model's side, so it is a stop."""
    return "length" if raw == "length" else "stop"


def _messages(request: GenerationRequest, prefix_text: str) -> list[dict[str, str]]:
    assert request.messages is not None
    msgs = [{"role": m.role, "content": m.content} for m in request.messages]
    if prefix_text:
        msgs.append({"role": "assistant", "content": prefix_text})
        msgs.append({"role": "user", "content": CONTINUE_INSTRUCTION})
    return msgs


def openai_request(request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None,
                   ignore_eos: bool = False) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of an OpenAI-compatible streaming request."""
    body: dict[str, Any] = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
    }
    if model:
        body["model"] = model
    if request.seed is not None:
        body["seed"] = request.seed
    if request.stop:
        body["stop"] = list(request.stop)
    if ignore_eos:  # a vLLM / llama.cpp server extension; other servers ignore unknown fields
        body["ignore_eos"] = True
    if request.messages is not None:
        body["messages"] = _messages(request, prefix_text)
        return "/v1/chat/completions", body
    body["prompt"] = (request.prompt or "") + prefix_text
    return "/v1/completions", body


def ollama_request(request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None
                   ) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of an Ollama native streaming request."""
    options: dict[str, Any] = {
        "num_predict": max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
    }
    if request.seed is not None:
        options["seed"] = request.seed
    if request.stop:
        options["stop"] = list(request.stop)
    body: dict[str, Any] = {"model": model or "", "stream": True, "options": options}
    if request.messages is not None:
        body["messages"] = _messages(request, prefix_text)
        return "/api/chat", body
    # raw: the prompt is completed as given (no template), like the local engine completes a prompt.
    body["prompt"] = (request.prompt or "") + prefix_text
    body["raw"] = True
    return "/api/generate", body


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err.get("error") or err)
    return str(err)


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_openai_event(data: str, *, chat: bool) -> Chunk:
    """One SSE ``data:`` payload of an OpenAI-compatible stream. Raises UpstreamError on an error event."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except ValueError:
        raise UpstreamError(f"upstream sent an event that is not JSON: {data[:200]!r}") from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"upstream sent an unexpected event: {data[:200]!r}")
    if "error" in obj:  # vLLM and llama.cpp report failures mid-stream this way
        raise UpstreamError(f"upstream error: {_error_message(obj['error'])}")
    raw_usage = obj.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
    completion_tokens = _int_or_none(usage.get("completion_tokens"))
    choices = obj.get("choices") or []
    if not choices:  # the include_usage record: usage only
        return Chunk(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    choice = choices[0]
    finish = choice.get("finish_reason")
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        # The opening {"role": "assistant"} (vLLM adds "content": "") announces the turn: not a token.
        if "role" in delta and not text:
            text = None
    else:
        text = choice.get("text")
    # The record that carries the finish reason is a token only if it carries text (vLLM); llama.cpp's
    # servers send an empty one after the last token.
    if finish is not None and not text:
        text = None
    return Chunk(piece=text if isinstance(text, str) else None,
                 finish_reason=map_finish_reason(finish) if finish is not None else None,
                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def parse_ollama_line(line: str, *, chat: bool) -> Chunk:
    """One NDJSON line of an Ollama native stream. Raises UpstreamError on an error record."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise UpstreamError(f"upstream sent a line that is not JSON: {line[:200]!r}") from None
    if not isinstance(obj, dict):
        raise UpstreamError(f"upstream sent an unexpected line: {line[:200]!r}")
    if "error" in obj:
        raise UpstreamError(f"upstream error: {_error_message(obj['error'])}")
    if chat:
        message = obj.get("message") or {}
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = obj.get("response")
    if obj.get("done"):
        return Chunk(piece=text or None, finish_reason=map_finish_reason(obj.get("done_reason")),
                     prompt_tokens=_int_or_none(obj.get("prompt_eval_count")),
                     completion_tokens=_int_or_none(obj.get("eval_count")), done=True)
    return Chunk(piece=text if isinstance(text, str) else None)


class SurrogateJoiner:
    """JSON ``\\u`` escapes can split a character outside the BMP into two surrogates in two deltas; Redis
    and the SSE stream need whole characters, so a trailing high surrogate waits for the next piece."""

    def __init__(self) -> None:
        self._held = ""

    def push(self, piece: str) -> str:
        text = self._held + piece
        self._held = ""
        if text and "\ud800" <= text[-1] <= "\udbff":
            self._held, text = text[-1], text[:-1]
        return _fix_surrogates(text)

    def flush(self) -> str:
        text, self._held = self._held, ""
        return _fix_surrogates(text)


def _fix_surrogates(text: str) -> str:
    if not any("\ud800" <= c <= "\udfff" for c in text):
        return text
    # Pairs become their character; a lone surrogate becomes U+FFFD (as invalid UTF-8 does locally).
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _parse_line(line: str, api: str, chat: bool) -> Chunk | None:
    if api == API_OLLAMA:
        return parse_ollama_line(line, chat=chat) if line.strip() else None
    # SSE: only data lines matter; comments (keep-alives), event names and blank lines do not.
    if not line.startswith("data:"):
        return None
    return parse_openai_event(line[5:].strip(), chat=chat)


def stream_pieces(lines: Iterable[str], *, api: str, chat: bool, generation: UpstreamGeneration, max_tokens: int,
                  stop: threading.Event) -> Iterator[str]:
    """The pieces of an upstream response, read line by line: one per delta that carries text (servers also
    send empty ones that are no token), then, when the upstream reported its token count, one empty piece
    per token whose text came merged into another delta. Sets ``generation``'s finish reason and counts.
    Ends early, quietly, once ``stop`` is set; raises UpstreamError on an error record or a cut stream."""
    n = 0
    ended = False
    joiner = SurrogateJoiner()
    for line in lines:
        chunk = _parse_line(line, api, chat)
        if chunk is None:
            continue
        if chunk.prompt_tokens is not None:
            generation.prompt_tokens = chunk.prompt_tokens
        if chunk.completion_tokens is not None:
            generation.completion_tokens = chunk.completion_tokens
        if chunk.piece:
            if stop.is_set():
                return
            n += 1
            if n >= max_tokens:
                # The budget is spent (a server that ignores max_tokens): end whatever it would send next.
                generation.finish_reason = "length"
                yield joiner.push(chunk.piece) + joiner.flush()
                return
            yield joiner.push(chunk.piece)
            if stop.is_set():
                return
        if chunk.finish_reason is not None:
            generation.finish_reason = chunk.finish_reason
            ended = True
        if chunk.done:
            break
    if stop.is_set():
        return
    if not ended:
        raise UpstreamError("the upstream closed the stream before the answer ended")
    tail = joiner.flush()
    if tail:
        yield tail
    # Servers hold back a token that ends inside a character (or might start a stop sequence) and send it
    # merged with the next, so deltas can be fewer than tokens. The missing ones follow as empty pieces, so
    # the worker's count (usage, the max_tokens left after a crash) is the upstream's.
    reported = generation.completion_tokens
    if reported is not None:
        for _ in range(min(reported, max_tokens) - n):
            yield ""


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


class UpstreamEngine:
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
        self.api = detect_api(url, api)
        self.base_url = base_url(url, self.api)
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
        path = "/v1/models" if self.api == API_OPENAI else "/api/tags"
        try:
            r = self._client.get(self.base_url + path, timeout=5.0)
            r.raise_for_status()
            listed = r.json().get("data" if self.api == API_OPENAI else "models") or []
            first = listed[0].get("id" if self.api == API_OPENAI else "name") if listed else None
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as e:
            log.warning("could not list the upstream's models: %s", e, extra={"upstream": self.base_url})
            return
        self._discovered = True
        if isinstance(first, str) and first:
            self._model = first
            self.name = first
            log.info("upstream model", extra={"upstream": self.base_url, "model": first})

    def build_request(self, request: GenerationRequest, prefix_text: str, max_tokens: int
                      ) -> tuple[str, dict[str, Any]]:
        if self.api == API_OPENAI:
            return openai_request(request, prefix_text=prefix_text, max_tokens=max_tokens, model=self._model,
                                  ignore_eos=self.ignore_eos)
        return ollama_request(request, prefix_text=prefix_text, max_tokens=max_tokens, model=self._model)

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
        path, body = self.build_request(request, prefix_text, max_tokens)
        chat = path in ("/v1/chat/completions", "/api/chat")
        aborter = _Aborter(stop)
        aborter.watch()
        try:
            with self._client.stream("POST", self.base_url + path, json=body,
                                     extensions={"trace": aborter.trace}) as response:
                if response.status_code >= 400:
                    raise UpstreamError(self._http_error(response))
                yield from stream_pieces(response.iter_lines(), api=self.api, chat=chat, generation=generation,
                                         max_tokens=max_tokens, stop=stop)
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
                text = _error_message(obj["error"])
            elif isinstance(obj, dict) and "detail" in obj:  # FastAPI-based servers
                text = str(obj["detail"])
        except ValueError:
            pass
        return f"upstream answered HTTP {response.status_code}: {text or response.reason_phrase}"

    def close(self) -> None:
        self._client.close()
