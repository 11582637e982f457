"""What the upstream protocols share: the request they build, the records (``Chunk``) their streams are
parsed into, and ``UpstreamPieces``, which turns those records into the pieces a Generation yields.

Pieces. The worker counts one token per text piece, so each piece is one upstream delta that carries text
(of the answer, of the reasoning, of a call's arguments). Servers send about one token per delta, but not
exactly: they hold back a token that ends inside a UTF-8 character or might start a stop sequence and send it
merged with the next one, and some send empty deltas that are no token. When the upstream reports usage at
the end (``stream_options.include_usage``: vLLM, llama.cpp's server, OpenAI, Ollama's /v1; ``eval_count``:
Ollama's native API), the tokens that came merged follow as empty pieces, so the worker's count is the
upstream's; that count is also kept in ``UpstreamGeneration.completion_tokens``. The usage record comes after
the finish chunk, so an answer that spends its budget is read on for it (a bounded tail: UpstreamEngine). Until
an upstream reports the prompt's count, ``prompt_tokens`` is its bound (broker.request.generation.prompt_token_bound):
what a cancelled generation is charged, and a generation of llama-cpp-python's server, which reports no usage when
streaming (with it ``completion_tokens`` is the number of deltas with text, a few less than the tokens).

Typed output. Reasoning (``reasoning_content`` / ``reasoning``; Ollama's ``thinking``) and tool calls
(``tool_calls`` pieces keyed by index, id and name first) become the markers of generator.engines.pieces.

Continuing an answer after a crash. ``prompt`` requests are exact: the prefix is appended to the prompt, as
the local engine does. Chat APIs offer no portable way to make the model continue its own partial message,
so a ``messages`` request whose answer so far is plain text gets it as an assistant message followed by a
user message asking to continue without repeating anything: the model usually complies, but the seam is not
guaranteed to be exact (a repeated word, a missing space). That cannot work inside a tool call, reasoning or
a JSON answer (``response_format``), which must come out whole and valid: those are *replayed*. The request
is sent again as it was first sent, and the pieces of the new answer that repeat what was stored are checked
against it and skipped; the first new piece goes on from where the stream stopped. That is exact when the
upstream samples deterministically (temperature 0, or a seed its sampler honours); when the new answer
differs from the stored one, the stream ends with an ``upstream`` error saying so, never with a piece twice
or a call that contradicts its start.
"""

from __future__ import annotations

import abc
import secrets
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from broker.request.generation import GenerationRequest
from generator.engines.base import EngineError, Generation, UpstreamCut, UpstreamError
from generator.engines.pieces import (
    REASONING,
    TEXT,
    Channel,
    Extra,
    PartialAnswer,
    Piece,
    TokenLogprob,
    ToolCallStart,
)

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
class CallPiece:
    """A piece of tool call ``index``: its id and name come with the first one (usually), then arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one upstream stream record means: a piece of text (None: not a token), of reasoning, of tool
    calls, an end, a usage."""

    piece: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False
    reasoning: str | None = None
    calls: tuple[CallPiece, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # of the text's tokens (an OpenAI-compatible server's logprobs.content)
    stop_sequence: str | None = None  # the stop string that ended the answer, when the server says (vLLM)


class UpstreamRefused(EngineError):
    """A request field this upstream's API cannot carry."""

    code = "invalid_request"


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
                      cache_scope: str = "") -> UpstreamRequest:
        """The path and JSON body of a streaming request (``prefix_text``: the plain answer text to continue,
        see the module doc; a replayed request gets ""; ``cache_scope``: Engine.start's)."""

    @abc.abstractmethod
    def reader(self, *, chat: bool) -> LineReader:
        """A parser of a response body's lines, one at a time."""

    @abc.abstractmethod
    def first_model(self, listing: Any) -> str | None:
        """The first model name of the server's listing (the JSON of ``models_path``)."""

    def chunks(self, lines: Iterable[str], *, chat: bool) -> Iterator[Chunk]:
        """The records of a whole body, read line by line. Raises UpstreamError on an error record."""
        reader = self.reader(chat=chat)
        for line in lines:
            chunk = reader.feed(line)
            if chunk is not None:
                yield chunk

    def base_url(self, url: str) -> str:
        """The server root: users paste ``http://host:8000/v1`` or ``http://host:11434/api`` as often as the
        root."""
        root = url.rstrip("/")
        if root.endswith(self.root_suffix):
            root = root[: -len(self.root_suffix)]
        return root


class LineReader(abc.ABC):
    @abc.abstractmethod
    def feed(self, line: str) -> Chunk | None:
        """The record this line completes, if any. Raises UpstreamError on an error record."""


def replays(request: GenerationRequest, prefix_text: str, partial: PartialAnswer | None) -> bool:
    """Whether a continued chat is replayed (see the module doc) rather than asked to go on."""
    if partial is not None and partial.typed:
        return True
    return bool(prefix_text) and request.messages is not None and request.response_format is not None


def continued_messages(request: GenerationRequest, prefix_text: str) -> list[dict[str, Any]]:
    """A chat request's messages in OpenAI's shape, with the partial answer to continue (see the module doc)."""
    assert request.messages is not None
    msgs = [m.as_openai() for m in request.messages]
    if prefix_text:
        msgs.append({"role": "assistant", "content": prefix_text})
        msgs.append({"role": "user", "content": CONTINUE_INSTRUCTION})
    return msgs


def map_finish_reason(raw: str | None) -> str:
    """The contract knows stop, length and tool_calls; anything else (eos, content_filter) ended the answer on
    the model's side, so it is a stop."""
    if raw in ("length", "tool_calls"):
        return raw
    return "tool_calls" if raw == "function_call" else "stop"


def error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err.get("error") or err)
    return str(err)


def int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def new_call_id() -> str:
    """For servers that send no call id (Ollama's native API)."""
    return "call_" + secrets.token_hex(12)


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


@dataclass(slots=True)
class _Call:
    id: str | None
    name: str | None
    held: list[str] = field(default_factory=list)  # arguments that came before the name
    started: bool = False


class UpstreamPieces:
    """The pieces of an upstream response, one record (``Chunk``) at a time: one text piece per delta that
    carries text (servers also send empty ones that are no token), markers where the kind changes, then, when
    the upstream reported its token count, one empty piece per token whose text came merged into another
    delta. Sets ``generation``'s finish reason and counts. ``over`` once the answer ended, the budget is
    spent or ``stop`` is set; ``end`` raises UpstreamError for a stream cut before its end."""

    def __init__(self, *, generation: UpstreamGeneration, max_tokens: int, stop: threading.Event,
                 replay: Replay | None = None) -> None:
        self.generation = generation
        self.max_tokens = max_tokens
        self.stop = stop
        self.over = False
        self._n = 0
        self._ended = False
        self._kind: Channel | int = replay.kind if replay is not None else TEXT
        self._calls: dict[int, _Call] = {}
        self._joiners: dict[Channel | int, SurrogateJoiner] = {}
        self._replay = replay
        self._token = False
        self._reported = False  # the upstream reported the prompt's count
        self._done = False  # the upstream's stream said it ended

    def count(self, chunk: Chunk) -> None:
        """The counts a record reports, if any (the usage record; Ollama's last line)."""
        gen = self.generation
        if chunk.prompt_tokens is not None:
            gen.prompt_tokens = chunk.prompt_tokens
            self._reported = True
        if chunk.completion_tokens is not None:
            gen.completion_tokens = chunk.completion_tokens
        if chunk.done:
            self._done = True

    @property
    def awaits_usage(self) -> bool:
        """The answer is over (its budget spent) while the upstream's stream goes on, its usage record not read
        yet: worth reading on for it (UpstreamEngine reads a bounded tail), so the prompt's count is the upstream's."""
        return self.over and not self._done and not self._reported and not self.stop.is_set()

    def feed(self, chunk: Chunk) -> list[Piece]:
        gen = self.generation
        self.count(chunk)
        out: list[Piece] = []
        self._token = False  # one token per record: a second text in it (reasoning and text) is Extra
        if chunk.reasoning:
            self._text(REASONING, chunk.reasoning, out)
        if chunk.piece:
            self._text(TEXT, chunk.piece, out)
            if not self.over:
                out.extend(chunk.logprobs)
        for c in chunk.calls:
            self._call(c, out)
        if self.over:
            return out
        if chunk.finish_reason is not None:
            gen.finish_reason = chunk.finish_reason
            gen.stop_sequence = chunk.stop_sequence
            self._ended = True
        if chunk.done:
            self.over = True
        return out

    def _text(self, kind: Channel | int, text: str, out: list[Piece]) -> None:
        if self.over or self.stop.is_set():
            self.over = True
            return
        if self._replay is not None:
            text = self._replay.skip(kind, text)
            if not text:
                return
        joiner = self._joiners.get(kind)
        if joiner is None:
            joiner = self._joiners[kind] = SurrogateJoiner()
        if kind != self._kind:
            self._switch(kind, out)
        if self._token:
            out.append(Extra(joiner.push(text)))
            return
        self._token = True
        self._n += 1
        if self._n >= self.max_tokens:
            # The budget is spent (a server that ignores max_tokens): end whatever it would send next.
            self.generation.finish_reason = "length"
            self._ended = self.over = True
            out.append(joiner.push(text) + joiner.flush())
            return
        out.append(joiner.push(text))
        if self.stop.is_set():
            self.over = True

    def _switch(self, kind: Channel | int, out: list[Piece]) -> None:
        prev = self._joiners.get(self._kind)
        if prev is not None:
            tail = prev.flush()  # a lone surrogate, as U+FFFD
            if tail:
                out.append(Extra(tail))
        if isinstance(kind, Channel):
            out.append(kind)
        else:
            call = self._calls[kind]
            if self._replay is not None and self._replay.announced(kind):
                raise UpstreamError("the upstream's replayed answer went back to an earlier tool call")
            out.append(ToolCallStart(kind, call.id or new_call_id(), call.name or ""))
            call.started = True
        self._kind = kind

    def _call(self, piece: CallPiece, out: list[Piece]) -> None:
        call = self._calls.get(piece.index)
        if call is None:
            call = self._calls[piece.index] = _Call(piece.id, piece.name)
            if self._replay is not None:
                self._replay.call_begins(piece.index, piece.name)
        else:
            call.id = call.id or piece.id
            call.name = call.name or piece.name
        if call.name is None:  # a server that sends the name after arguments: hold them until it comes
            if piece.arguments:
                call.held.append(piece.arguments)
            return
        if self._replay is not None and self._replay.announced(piece.index):
            self._kind_is(piece.index)
            if piece.arguments:
                self._text(piece.index, piece.arguments, out)
            return
        if not call.started:
            if self.over or self.stop.is_set():
                return
            self._switch(piece.index, out)
            for held in call.held:
                self._text(piece.index, held, out)
            call.held.clear()
        if piece.arguments:
            self._text(piece.index, piece.arguments, out)

    def _kind_is(self, index: int) -> None:
        """A call announced before the crash goes on: its pieces continue it, no marker announces it again."""
        if self._kind != index and self._replay is not None and self._replay.kind == index:
            self._kind = index

    def end(self) -> list[Piece]:
        """After the last record: the text still held, the tokens that came merged (as empty pieces)."""
        if self.stop.is_set():
            return []
        if not self._ended:
            raise UpstreamCut("the upstream closed the stream before the answer ended")
        if self._replay is not None:
            self._replay.finished()
        out: list[Piece] = []
        joiner = self._joiners.get(self._kind)
        if joiner is not None:
            tail = joiner.flush()
            if tail:
                out.append(Extra(tail))
        # Servers hold back a token that ends inside a character (or might start a stop sequence) and send it
        # merged with the next, so deltas can be fewer than tokens. The missing ones follow as empty pieces, so
        # the worker's count (usage, the max_tokens left after a crash) is the upstream's.
        reported = self.generation.completion_tokens
        if reported is not None:
            skipped = self._replay.skipped if self._replay is not None else 0
            out.extend("" for _ in range(min(reported - skipped, self.max_tokens) - self._n))
        return out


class Replay:
    """What a replayed answer must repeat before it may go on (see the module doc): per kind, the stored text
    not yet repeated. ``skip`` returns the part of a piece that is new."""

    def __init__(self, prefix_text: str, partial: PartialAnswer | None) -> None:
        partial = partial or PartialAnswer()
        self.kind: Channel | int = partial.ends_in
        self._left: dict[Channel | int, str] = {TEXT: prefix_text, REASONING: partial.reasoning}
        self._names = {c.index: c.name for c in partial.calls}
        for c in partial.calls:
            self._left[c.index] = c.arguments
        self.skipped = 0

    def announced(self, index: int) -> bool:
        return index in self._names

    def call_begins(self, index: int, name: str | None) -> None:
        if index in self._names and name is not None and name != self._names[index]:
            raise UpstreamError(f"the upstream's replayed answer calls {name!r} where it had called "
                                f"{self._names[index]!r}: the interrupted answer cannot be continued exactly "
                                "(its sampling is not deterministic)")

    def skip(self, kind: Channel | int, text: str) -> str:
        left = self._left.get(kind, "")
        if not left:
            return text
        n = min(len(left), len(text))
        if text[:n] != left[:n]:
            raise UpstreamError("the upstream's replayed answer differs from the stored one: the interrupted "
                                "answer cannot be continued exactly (its sampling is not deterministic)")
        self._left[kind] = left[n:]
        if n == len(text):
            self.skipped += 1
        return text[n:]

    def finished(self) -> None:
        if any(self._left.values()):
            raise UpstreamError("the upstream's replayed answer ended before reaching where the stored one "
                                "stopped: the interrupted answer cannot be continued exactly")


def stream_pieces(chunks: Iterable[Chunk], *, generation: UpstreamGeneration, max_tokens: int,
                  stop: threading.Event, replay: Replay | None = None) -> Iterator[Piece]:
    """``UpstreamPieces`` over a whole sequence of records (the engine feeds them as they arrive)."""
    pieces = UpstreamPieces(generation=generation, max_tokens=max_tokens, stop=stop, replay=replay)
    for chunk in chunks:
        yield from pieces.feed(chunk)
        if pieces.over:
            break
    yield from pieces.end()
