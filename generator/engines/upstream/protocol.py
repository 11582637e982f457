"""What the upstream protocols share: the request they build, the records (``Chunk``) their streams are
parsed into, and the loop that turns those records into the pieces a Generation yields.

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
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from broker.request import GenerationRequest
from generator.engines.base import Generation, UpstreamError

#: Sent (as a user message) after the partial answer when a chat generation is continued after a crash.
CONTINUE_INSTRUCTION = (
    "Continue your previous reply from exactly where it stopped. Output only the continuation: "
    "no preamble, and do not repeat any text you already wrote."
)


@dataclass(slots=True)
class UpstreamGeneration(Generation):
    """A Generation that also keeps the upstream's own count of generated tokens, when it reports one."""

    completion_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    path: str
    body: dict[str, Any]
    chat: bool  # messages (a chat API), not a plain prompt (a completion API)


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one upstream stream record means: a piece of text (None: not a token), an end, a usage."""

    piece: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False


class UpstreamProtocol(abc.ABC):
    """One server API: how its requests are built, its streams parsed and its models listed."""

    #: The ``--upstream-api`` value naming it.
    name: str
    #: The path prefix users often paste with the URL (``/v1``, ``/api``); the root is the URL without it.
    root_suffix: str
    #: Where the server lists its models (the first is used when ``--upstream-model`` is not given).
    models_path: str

    @abc.abstractmethod
    def build_request(self, request: GenerationRequest, *, prefix_text: str, max_tokens: int, model: str | None,
                      ignore_eos: bool = False) -> UpstreamRequest:
        """The path and JSON body of a streaming request."""

    @abc.abstractmethod
    def chunks(self, lines: Iterable[str], *, chat: bool) -> Iterator[Chunk]:
        """The records of a response body, read line by line. Raises UpstreamError on an error record."""

    @abc.abstractmethod
    def first_model(self, listing: Any) -> str | None:
        """The first model name of the server's listing (the JSON of ``models_path``)."""

    def base_url(self, url: str) -> str:
        """The server root: users paste ``http://host:8000/v1`` or ``http://host:11434/api`` as often as the
        root."""
        root = url.rstrip("/")
        if root.endswith(self.root_suffix):
            root = root[: -len(self.root_suffix)]
        return root


def continued_messages(request: GenerationRequest, prefix_text: str) -> list[dict[str, str]]:
    """A chat request's messages, with the partial answer to continue (see the module doc)."""
    assert request.messages is not None
    msgs = [{"role": m.role, "content": m.content} for m in request.messages]
    if prefix_text:
        msgs.append({"role": "assistant", "content": prefix_text})
        msgs.append({"role": "user", "content": CONTINUE_INSTRUCTION})
    return msgs


def map_finish_reason(raw: str | None) -> str:
    """The contract knows only stop and length; anything else (eos, content_filter, tool_calls) ended the
    answer on the model's side, so it is a stop."""
    return "length" if raw == "length" else "stop"


def error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err.get("error") or err)
    return str(err)


def int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


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


def stream_pieces(chunks: Iterable[Chunk], *, generation: UpstreamGeneration, max_tokens: int,
                  stop: threading.Event) -> Iterator[str]:
    """The pieces of an upstream response: one per delta that carries text (servers also send empty ones
    that are no token), then, when the upstream reported its token count, one empty piece per token whose
    text came merged into another delta. Sets ``generation``'s finish reason and counts. Ends early,
    quietly, once ``stop`` is set; raises UpstreamError on an error record or a cut stream."""
    n = 0
    ended = False
    joiner = SurrogateJoiner()
    for chunk in chunks:
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
