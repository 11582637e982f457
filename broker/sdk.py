"""The Python client of the rsb HTTP/SSE API: ``Client`` (sync) and ``AsyncClient`` (asyncio), over httpx.

    from broker.sdk import Client

    with Client("http://127.0.0.1:8000") as rsb:
        info = rsb.create(messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=200)
        for event in rsb.stream(info.id):
            print(event.text, end="", flush=True)

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
import email.utils
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

TERMINAL_EVENTS = frozenset({"done", "cancelled", "error"})
DEFAULT_URL = "http://127.0.0.1:8000"

# Statuses worth retrying: the server (or a proxy in front of it) is briefly unable to answer.
_RETRY_STATUSES = frozenset({429, 502, 503, 504})


# -- errors ------------------------------------------------------------------------------------------


class RsbClientError(Exception):
    """Base of every error this client raises. ``status_code`` is the HTTP status (None: no response) and
    ``code`` the contract's error code (``not_found``, ``conflict``, ...)."""

    def __init__(self, message: str, *, status_code: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code


class InvalidRequestError(RsbClientError):
    """400: the server refused the request as malformed (bad id, bad fields, bad resume id)."""


class AuthenticationError(RsbClientError):
    """401: a missing or unknown API key."""


class NotFoundError(RsbClientError):
    """404: no stream with this id (or not one the API key may see)."""


class ConflictError(RsbClientError):
    """409: a stream with this id exists with a different request."""


class ExpiredError(RsbClientError):
    """410: the stream existed and passed its retention period."""


class PayloadTooLargeError(RsbClientError):
    """413: the request body is larger than the server accepts."""


class RateLimitedError(RsbClientError):
    """429: the queue is full or too many connections are open; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, status_code: int | None = 429,
                 code: str | None = None) -> None:
        super().__init__(message, status_code=status_code, code=code)
        self.retry_after = retry_after


class UnavailableError(RsbClientError):
    """The server could not be reached or answered 502/503/504, through every retry."""

    def __init__(self, message: str, *, retry_after: float | None = None, status_code: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, status_code=status_code, code=code)
        self.retry_after = retry_after


class StreamInterrupted(UnavailableError):
    """Reading a stream failed ``attempts`` times in a row. ``last_event_id`` is where to resume."""

    def __init__(self, message: str, *, last_event_id: str | None, attempts: int) -> None:
        super().__init__(message)
        self.last_event_id = last_event_id
        self.attempts = attempts


_BY_STATUS: dict[int, type[RsbClientError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    410: ExpiredError,
    413: PayloadTooLargeError,
}


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: a number, or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_response(status_code: int, headers: Mapping[str, str], body: bytes) -> RsbClientError:
    """The typed exception for an error response (``{"error": {"code", "message"}}`` by the contract)."""
    code: str | None = None
    message = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status_code}"
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            code = err.get("code")
            message = str(err.get("message") or message)
    except (ValueError, AttributeError):
        pass  # not the contract's JSON (a proxy's error page): keep the raw text
    retry_after = parse_retry_after(headers.get("retry-after"))
    if status_code == 429:
        return RateLimitedError(message, retry_after=retry_after, code=code)
    if status_code in (502, 503, 504):
        return UnavailableError(message, retry_after=retry_after, status_code=status_code, code=code)
    cls = _BY_STATUS.get(status_code, RsbClientError)
    return cls(message, status_code=status_code, code=code)


# -- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a stream: ``id`` (opaque, echo it back to resume), ``type`` and its decoded ``data``."""

    id: str
    type: str
    data: Any

    @property
    def text(self) -> str:
        """The text a ``delta`` appends to the answer ("" for every other type)."""
        if self.type == "delta" and isinstance(self.data, dict):
            return str(self.data.get("text", ""))
        return ""

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """The answer to ``create``: ``created`` is False when the id already existed with this request."""

    id: str
    status: str
    events_url: str
    created: bool
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StreamStatus:
    id: str
    status: str
    model: str | None = None
    created_at: str | None = None
    usage: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in ("done", "cancelled", "error")


def _status(body: dict[str, Any]) -> StreamStatus:
    return StreamStatus(id=body["id"], status=body["status"], model=body.get("model"),
                        created_at=body.get("created_at"), usage=body.get("usage"), raw=body)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter: attempt ``n`` (from 0) waits a random time in
    ``[0, min(max_delay_s, base_delay_s * 2**n)]``, so clients that lost the same server do not come back
    in lockstep. ``max_retries`` failed attempts in a row (none delivering an event) give up."""

    max_retries: int = 8
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        d = random.uniform(0.0, min(self.max_delay_s, self.base_delay_s * 2**attempt))
        if retry_after is not None:  # the server said when; still bounded, so a huge value cannot hang us
            d = max(d, min(retry_after, self.max_delay_s))
        return d


def build_create_body(*, messages: Sequence[Mapping[str, str]] | None, prompt: str | None, id: str | None,
                      model: str | None, max_tokens: int | None, temperature: float | None,
                      top_p: float | None, seed: int | None, stop: Sequence[str] | None,
                      cancel_on_disconnect: bool | None) -> dict[str, Any]:
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages or prompt")
    body: dict[str, Any] = {"id": id or str(uuid.uuid4())}
    if messages is not None:
        body["messages"] = [dict(m) for m in messages]
    else:
        body["prompt"] = prompt
    optional = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "seed": seed, "stop": list(stop) if stop is not None else None,
                "cancel_on_disconnect": cancel_on_disconnect}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


class SSEDecoder:
    """Incremental SSE parsing, one line at a time (the server's framing: ``id``, ``event``, ``data``; ``:``
    comments are heartbeats; ``retry`` is a reconnect hint). An event is only complete at its blank line, so
    a connection cut mid-event drops that event and the resume asks for it again."""

    def __init__(self) -> None:
        self._id: str | None = None
        self._type = "message"
        self._data: list[str] = []
        self.retry_ms: int | None = None

    def feed(self, line: str) -> Event | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "id":
            self._id = value
        elif name == "event":
            self._type = value
        elif name == "data":
            self._data.append(value)
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> Event | None:
        eid, etype, data = self._id, self._type, self._data
        self._id, self._type, self._data = None, "message", []
        if eid is None or not data:  # a bare `retry:` block, or no event at all
            return None
        raw = "\n".join(data)
        try:
            decoded: Any = json.loads(raw)
        except ValueError:
            decoded = raw
        return Event(id=eid, type=etype, data=decoded)


# Failures after which reading a stream reconnects: the connection or the server went away.
_TRANSIENT = (httpx.TransportError, UnavailableError, RateLimitedError)


class _Base:
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

    @staticmethod
    def _events_path(stream_id: str) -> str:
        return f"/v1/streams/{stream_id}/events"

    @staticmethod
    def _resume_headers(last_event_id: str | None) -> dict[str, str]:
        h = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            h["Last-Event-ID"] = last_event_id
        return h


class Client(_Base):
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
        """One API call; connection failures and 502/503/504 are retried (every call here is idempotent)."""
        attempt = 0
        while True:
            try:
                r = self._http.request(method, path, json=json_body)
                if r.status_code < 400:
                    return r
                err = error_from_response(r.status_code, r.headers, r.content)
                if not isinstance(err, UnavailableError):
                    raise err
                cause: Exception = err
                retry_after = err.retry_after
            except httpx.TransportError as e:
                cause, retry_after = e, None
            if attempt >= self.retry.max_retries:
                raise UnavailableError(f"{method} {path} failed after {attempt + 1} attempts: {cause}") from cause
            time.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1

    def create(self, *, messages: Sequence[Mapping[str, str]] | None = None, prompt: str | None = None,
               id: str | None = None, model: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] | None = None, cancel_on_disconnect: bool | None = None) -> StreamInfo:
        """Start a generation (exactly one of ``messages`` / ``prompt``). Idempotent by ``id``, which is a
        new UUID when not given; a full queue raises RateLimitedError (not retried: that is the caller's
        call)."""
        body = build_create_body(messages=messages, prompt=prompt, id=id, model=model, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                                 cancel_on_disconnect=cancel_on_disconnect)
        d = self._request("POST", "/v1/streams", json_body=body).json()
        return StreamInfo(id=d["id"], status=d["status"], events_url=d["events_url"], created=d["created"], raw=d)

    def status(self, stream_id: str) -> StreamStatus:
        return _status(self._request("GET", f"/v1/streams/{stream_id}").json())

    def cancel(self, stream_id: str) -> StreamStatus:
        """Ask the generation to stop; the stream then ends with a ``cancelled`` event. Idempotent."""
        return _status(self._request("POST", f"/v1/streams/{stream_id}/cancel").json())

    def stream(self, stream_id: str, last_event_id: str | None = None) -> Iterator[Event]:
        """Every event after ``last_event_id`` (None: from the start), resuming across disconnects, until
        the terminal event. Raises NotFoundError/ExpiredError/... at once, StreamInterrupted after the
        retry cap."""
        attempt = 0
        last = last_event_id
        while True:
            retry_after: float | None = None
            try:
                with self._http.stream("GET", self._events_path(stream_id), headers=self._resume_headers(last),
                                       timeout=self.stream_timeout) as r:
                    if r.status_code == 204:  # the resume point is the terminal event: nothing follows
                        return
                    if r.status_code != 200:
                        raise error_from_response(r.status_code, r.headers, r.read())
                    decoder = SSEDecoder()
                    for line in r.iter_lines():
                        event = decoder.feed(line)
                        if event is None:
                            continue
                        last = event.id
                        attempt = 0  # progress: the cap counts failures in a row
                        yield event
                        if event.terminal:
                            return
                # The body ended without a terminal event (the pod shut down, a proxy cut it): resume.
                cause: Exception = UnavailableError("the stream closed before its terminal event")
            except _TRANSIENT as e:
                cause = e
                retry_after = getattr(e, "retry_after", None)
            if attempt >= self.retry.max_retries:
                raise StreamInterrupted(f"reading stream {stream_id} failed {attempt + 1} times in a row: {cause}",
                                        last_event_id=last, attempts=attempt + 1) from cause
            time.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1

    def text(self, stream_id: str, last_event_id: str | None = None) -> tuple[str, Event | None]:
        """The answer after ``last_event_id`` once the stream ends, and its terminal event."""
        parts: list[str] = []
        end: Event | None = None
        for event in self.stream(stream_id, last_event_id):
            parts.append(event.text)
            if event.terminal:
                end = event
        return "".join(parts), end


class AsyncClient(_Base):
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
        attempt = 0
        while True:
            try:
                r = await self._http.request(method, path, json=json_body)
                if r.status_code < 400:
                    return r
                err = error_from_response(r.status_code, r.headers, r.content)
                if not isinstance(err, UnavailableError):
                    raise err
                cause: Exception = err
                retry_after = err.retry_after
            except httpx.TransportError as e:
                cause, retry_after = e, None
            if attempt >= self.retry.max_retries:
                raise UnavailableError(f"{method} {path} failed after {attempt + 1} attempts: {cause}") from cause
            await asyncio.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1

    async def create(self, *, messages: Sequence[Mapping[str, str]] | None = None, prompt: str | None = None,
                     id: str | None = None, model: str | None = None, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                     stop: Sequence[str] | None = None, cancel_on_disconnect: bool | None = None) -> StreamInfo:
        body = build_create_body(messages=messages, prompt=prompt, id=id, model=model, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                                 cancel_on_disconnect=cancel_on_disconnect)
        d = (await self._request("POST", "/v1/streams", json_body=body)).json()
        return StreamInfo(id=d["id"], status=d["status"], events_url=d["events_url"], created=d["created"], raw=d)

    async def status(self, stream_id: str) -> StreamStatus:
        return _status((await self._request("GET", f"/v1/streams/{stream_id}")).json())

    async def cancel(self, stream_id: str) -> StreamStatus:
        return _status((await self._request("POST", f"/v1/streams/{stream_id}/cancel")).json())

    async def stream(self, stream_id: str, last_event_id: str | None = None) -> AsyncIterator[Event]:
        attempt = 0
        last = last_event_id
        while True:
            retry_after: float | None = None
            try:
                async with self._http.stream("GET", self._events_path(stream_id),
                                             headers=self._resume_headers(last), timeout=self.stream_timeout) as r:
                    if r.status_code == 204:
                        return
                    if r.status_code != 200:
                        raise error_from_response(r.status_code, r.headers, await r.aread())
                    decoder = SSEDecoder()
                    async for line in r.aiter_lines():
                        event = decoder.feed(line)
                        if event is None:
                            continue
                        last = event.id
                        attempt = 0
                        yield event
                        if event.terminal:
                            return
                cause: Exception = UnavailableError("the stream closed before its terminal event")
            except _TRANSIENT as e:
                cause = e
                retry_after = getattr(e, "retry_after", None)
            if attempt >= self.retry.max_retries:
                raise StreamInterrupted(f"reading stream {stream_id} failed {attempt + 1} times in a row: {cause}",
                                        last_event_id=last, attempts=attempt + 1) from cause
            await asyncio.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1

    async def text(self, stream_id: str, last_event_id: str | None = None) -> tuple[str, Event | None]:
        parts: list[str] = []
        end: Event | None = None
        async for event in self.stream(stream_id, last_event_id):
            parts.append(event.text)
            if event.terminal:
                end = event
        return "".join(parts), end
