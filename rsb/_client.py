"""``Client`` (sync) and ``AsyncClient`` (asyncio) over httpx: twins that share every decision.

The decisions (which answers are retried, how long to wait, what a line of the event stream means, when
a read is over, when to give up) live in ``_Calls`` and ``_StreamRead``; the twins only do the I/O, the
one thing that differs between them.

``create`` picks the stream id (a UUID) when the caller gives none, so retrying it after a lost reply is
safe: the server answers an identical request for a known id with the existing stream. ``stream`` yields
every event after ``last_event_id`` exactly once and ends after the terminal event (``done``,
``cancelled`` or ``error``: these end the stream, they are not raised). When the connection drops it
reconnects with ``Last-Event-ID`` after an exponential backoff with full jitter, and raises
``StreamInterrupted`` (with the last event id, to resume later) after ``max_retries`` attempts in a row
that delivered nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from broker.backoff import Backoff
from broker.request.sampling import FIELDS as SAMPLING_FIELDS
from broker.sse import LineDecoder
from rsb._exceptions import (
    RateLimitedError,
    RsbClientError,
    StreamInterrupted,
    UnavailableError,
    error_from_response,
)
from rsb._types import Answer, Event, StreamInfo, StreamStatus

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter (broker.backoff): attempt ``n`` (from 0) waits a random time in
    ``[0, min(max_delay_s, base_delay_s * 2**n)]``, so clients that lost the same server do not come back
    in lockstep. ``max_retries`` failed attempts in a row (none delivering an event) give up."""

    max_retries: int = 8
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        return Backoff(self.base_delay_s, self.max_delay_s, floor=0.0).delay(attempt, retry_after)


def build_create_body(*, messages: Sequence[Mapping[str, Any]] | None, prompt: str | None, id: str | None,
                      model: str | None, max_tokens: int | None, temperature: float | None,
                      top_p: float | None, seed: int | None, stop: Sequence[str] | None,
                      cancel_on_disconnect: bool | None, tools: Sequence[Mapping[str, Any]] | None = None,
                      tool_choice: str | Mapping[str, Any] | None = None,
                      response_format: Mapping[str, Any] | None = None,
                      conversation: str | None = None, **sampling: Any) -> dict[str, Any]:
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages or prompt")
    body: dict[str, Any] = {"id": id or str(uuid.uuid4())}
    if messages is not None:
        body["messages"] = [dict(m) for m in messages]
    else:
        body["prompt"] = prompt
    optional = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "seed": seed, "stop": list(stop) if stop is not None else None,
                "cancel_on_disconnect": cancel_on_disconnect,
                "tools": [dict(t) for t in tools] if tools is not None else None,
                "tool_choice": tool_choice if isinstance(tool_choice, str | None) else dict(tool_choice),
                "response_format": dict(response_format) if response_format is not None else None,
                "conversation": conversation}
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    optional.update(sampling)  # presence_penalty, frequency_penalty, logit_bias, parallel_tool_calls, max_tool_calls
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


class _Calls:
    """The retry loop of one API call: every call here is idempotent, so connection failures and
    502/503/504/507 (rsb._exceptions.RETRIED_STATUSES) are retried; anything else is raised at once."""

    def __init__(self, method: str, path: str, retry: RetryPolicy) -> None:
        self.method, self.path, self.retry = method, path, retry
        self.attempt = 0

    def check(self, response: httpx.Response) -> httpx.Response | float:
        """The response when it is a success; else the delay before the next try (or raise)."""
        if response.status_code < 400:
            return response
        err = error_from_response(response.status_code, response.headers, response.content)
        if not isinstance(err, UnavailableError):
            raise err
        return self.failed(err, err.retry_after)

    def failed(self, cause: Exception, retry_after: float | None = None) -> float:
        if self.attempt >= self.retry.max_retries:
            raise UnavailableError(f"{self.method} {self.path} failed after {self.attempt + 1} attempts: "
                                   f"{cause}") from cause
        delay = self.retry.delay(self.attempt, retry_after)
        self.attempt += 1
        return delay


# Failures after which reading a stream reconnects: the connection or the server went away.
_TRANSIENT = (httpx.TransportError, UnavailableError, RateLimitedError)


class _StreamRead:
    """One ``stream()`` call: where to resume, what each line means, when to give up."""

    def __init__(self, stream_id: str, last_event_id: str | None, retry: RetryPolicy, latest: bool = False) -> None:
        self.stream_id = stream_id
        self.latest = latest
        self.last = last_event_id
        self.retry = retry
        self.attempt = 0
        self.decoder = LineDecoder()
        self.ended = False

    @property
    def path(self) -> str:
        # From the latest, reconnects keep the query: after the last id, a snapshot where a reset would come.
        return f"/v1/streams/{self.stream_id}/events" + ("?from=latest" if self.latest else "")

    def headers(self) -> dict[str, str]:
        self.decoder = LineDecoder()  # a new connection: nothing of a cut event carries over
        h = {"Accept": "text/event-stream"}
        if self.last is not None:
            h["Last-Event-ID"] = self.last
        return h

    def opened(self, status_code: int) -> bool:
        """Whether to read the body (False: 204, the resume point is the terminal event: nothing follows)."""
        if status_code == 204:
            self.ended = True
        return status_code == 200

    def feed(self, line: str) -> Event | None:
        """The event a line completes, if any (an event is only complete at its blank line, so a connection
        cut mid-event drops it, and the resume asks for it again)."""
        block = self.decoder.feed(line)
        if block is None or block.id is None or not block.is_event:  # a comment, a bare `retry:`
            return None
        try:
            data: Any = json.loads(block.data)
        except ValueError:
            data = block.data
        event = Event(id=block.id, type=block.type, data=data)
        self.last = event.id
        self.attempt = 0  # progress: the cap counts failures in a row
        self.ended = event.terminal
        return event

    def failed(self, cause: Exception | None) -> float:
        """The delay before reconnecting (or raise StreamInterrupted past the cap). ``cause`` None: the body
        ended before the terminal event (the pod shut down, a proxy cut it)."""
        err = cause or UnavailableError("the stream closed before its terminal event")
        if isinstance(err, RsbClientError) and not isinstance(err, _TRANSIENT):
            raise err
        if self.attempt >= self.retry.max_retries:
            raise StreamInterrupted(f"reading stream {self.stream_id} failed {self.attempt + 1} times in a row: "
                                    f"{err}", last_event_id=self.last, attempts=self.attempt + 1) from err
        delay = self.retry.delay(self.attempt, getattr(err, "retry_after", None))
        self.attempt += 1
        return delay


class _BaseClient:
    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, read_timeout_s: float,
                 retry: RetryPolicy | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.headers: dict[str, str] = {"Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = httpx.Timeout(timeout_s)
        # Reading a stream: the server sends a heartbeat every --heartbeat-s (15 s by default), so a longer
        # silence means the connection is dead even if no error says so.
        self.stream_timeout = httpx.Timeout(timeout_s, read=read_timeout_s)


class Client(_BaseClient):
    """Synchronous client. Thread-safe like the httpx.Client under it; use it as a context manager or
    ``close()`` it."""

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, timeout_s: float = 30.0,
                 read_timeout_s: float = 60.0, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, timeout_s, read_timeout_s, retry)
        self._http = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                  transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, json_body: Any = None) -> httpx.Response:
        calls = _Calls(method, path, self.retry)
        while True:
            try:
                outcome = calls.check(self._http.request(method, path, json=json_body))
            except httpx.TransportError as e:
                outcome = calls.failed(e)
            if isinstance(outcome, httpx.Response):
                return outcome
            time.sleep(outcome)

    def create(self, *, messages: Sequence[Mapping[str, Any]] | None = None, prompt: str | None = None,
               id: str | None = None, model: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] | None = None, cancel_on_disconnect: bool | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
               response_format: Mapping[str, Any] | None = None, conversation: str | None = None,
               **sampling: Any) -> StreamInfo:
        """Start a generation (exactly one of ``messages`` / ``prompt``). Idempotent by ``id``, which is a
        new UUID when not given; a full queue raises RateLimitedError (not retried: that is the caller's
        call). ``tools``, ``tool_choice`` and ``response_format`` take OpenAI's shapes. ``conversation`` (a
        UUID of yours): the messages are the conversation's next turn, the server puts its history in front
        (ConflictError while another of its turns runs). ``sampling``: OpenAI's ``presence_penalty``,
        ``frequency_penalty``, ``logit_bias``, ``parallel_tool_calls`` and ``max_tool_calls``."""
        body = build_create_body(messages=messages, prompt=prompt, id=id, model=model, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                                 cancel_on_disconnect=cancel_on_disconnect, tools=tools, tool_choice=tool_choice,
                                 response_format=response_format, conversation=conversation, **sampling)
        return StreamInfo.from_json(self._request("POST", "/v1/streams", json_body=body).json())

    def status(self, stream_id: str) -> StreamStatus:
        return StreamStatus.from_json(self._request("GET", f"/v1/streams/{stream_id}").json())

    def cancel(self, stream_id: str) -> StreamStatus:
        """Ask the generation to stop; the stream then ends with a ``cancelled`` event. Idempotent."""
        return StreamStatus.from_json(self._request("POST", f"/v1/streams/{stream_id}/cancel").json())

    def stream(self, stream_id: str, last_event_id: str | None = None, *, latest: bool = False) -> Iterator[Event]:
        """Every event after ``last_event_id`` (None: from the start), resuming across disconnects, until
        the terminal event. ``latest``: first a ``snapshot`` of the answer as it stands, then the events after it
        (a late joiner; ``Answer.feed`` applies it). Raises NotFoundError/ExpiredError/... at once,
        StreamInterrupted after the retry cap."""
        read = _StreamRead(stream_id, last_event_id, self.retry, latest)
        while True:
            cause: Exception | None = None
            try:
                with self._http.stream("GET", read.path, headers=read.headers(), timeout=self.stream_timeout) as r:
                    if not read.opened(r.status_code):
                        if read.ended:
                            return
                        raise error_from_response(r.status_code, r.headers, r.read())
                    for line in r.iter_lines():
                        event = read.feed(line)
                        if event is not None:
                            yield event
                            if read.ended:
                                return
            except (httpx.TransportError, RsbClientError) as e:
                cause = e
            time.sleep(read.failed(cause))

    def answer(self, stream_id: str, last_event_id: str | None = None) -> Answer:
        """The answer after ``last_event_id`` once the stream ends: text, reasoning, tool calls, the terminal
        event (``end``), resets applied."""
        answer = Answer()
        for event in self.stream(stream_id, last_event_id):
            answer.feed(event)
        return answer

    def text(self, stream_id: str, last_event_id: str | None = None) -> tuple[str, Event | None]:
        """The answer's text after ``last_event_id`` once the stream ends, and its terminal event."""
        answer = self.answer(stream_id, last_event_id)
        return answer.text, answer.end


class AsyncClient(_BaseClient):
    """The asyncio twin of ``Client``: the same methods, awaited (``stream`` is an async iterator)."""

    def __init__(self, base_url: str = DEFAULT_URL, *, api_key: str | None = None, timeout_s: float = 30.0,
                 read_timeout_s: float = 60.0, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, timeout_s, read_timeout_s, retry)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                       transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, json_body: Any = None) -> httpx.Response:
        calls = _Calls(method, path, self.retry)
        while True:
            try:
                outcome = calls.check(await self._http.request(method, path, json=json_body))
            except httpx.TransportError as e:
                outcome = calls.failed(e)
            if isinstance(outcome, httpx.Response):
                return outcome
            await asyncio.sleep(outcome)

    async def create(self, *, messages: Sequence[Mapping[str, Any]] | None = None, prompt: str | None = None,
                     id: str | None = None, model: str | None = None, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                     stop: Sequence[str] | None = None, cancel_on_disconnect: bool | None = None,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     tool_choice: str | Mapping[str, Any] | None = None,
                     response_format: Mapping[str, Any] | None = None,
                     conversation: str | None = None, **sampling: Any) -> StreamInfo:
        body = build_create_body(messages=messages, prompt=prompt, id=id, model=model, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                                 cancel_on_disconnect=cancel_on_disconnect, tools=tools, tool_choice=tool_choice,
                                 response_format=response_format, conversation=conversation, **sampling)
        return StreamInfo.from_json((await self._request("POST", "/v1/streams", json_body=body)).json())

    async def status(self, stream_id: str) -> StreamStatus:
        return StreamStatus.from_json((await self._request("GET", f"/v1/streams/{stream_id}")).json())

    async def cancel(self, stream_id: str) -> StreamStatus:
        return StreamStatus.from_json((await self._request("POST", f"/v1/streams/{stream_id}/cancel")).json())

    async def stream(self, stream_id: str, last_event_id: str | None = None, *,
                     latest: bool = False) -> AsyncIterator[Event]:
        read = _StreamRead(stream_id, last_event_id, self.retry, latest)
        while True:
            cause: Exception | None = None
            try:
                async with self._http.stream("GET", read.path, headers=read.headers(),
                                             timeout=self.stream_timeout) as r:
                    if not read.opened(r.status_code):
                        if read.ended:
                            return
                        raise error_from_response(r.status_code, r.headers, await r.aread())
                    async for line in r.aiter_lines():
                        event = read.feed(line)
                        if event is not None:
                            yield event
                            if read.ended:
                                return
            except (httpx.TransportError, RsbClientError) as e:
                cause = e
            await asyncio.sleep(read.failed(cause))

    async def answer(self, stream_id: str, last_event_id: str | None = None) -> Answer:
        answer = Answer()
        async for event in self.stream(stream_id, last_event_id):
            answer.feed(event)
        return answer

    async def text(self, stream_id: str, last_event_id: str | None = None) -> tuple[str, Event | None]:
        answer = await self.answer(stream_id, last_event_id)
        return answer.text, answer.end
