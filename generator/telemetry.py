"""A generation attempt's spans, its upstream call's client span, and the GenAI metrics (broker.genai's names).

Spans, under the create's request span (its traceparent came with the claim: broker.streams.job_store), whichever
worker claims the job:

- ``queue wait`` (a job's first attempt): from the create to this claim, drawn at the claim;
- ``{operation} {model}``, the attempt (``rsb.generation.attempt``: a continuation after a crash or a hand-over is
  another one, attempt 2...), current while it runs (its log lines carry its ids), with two phases below it, drawn
  when it ends: ``prefill`` (or ``time to first token`` for an upstream) then ``decode``; the appends of its events
  are counted on the attempt (how many, their time in all, the slowest), with events at the milestones a reader
  sees (the first token, the first text visible, the terminal event): a 4,000-token answer is a handful of spans;
- an upstream engine's request: a client span whose traceparent the upstream receives (``upstream_span``).

With tracing off (broker.telemetry.TRACER None) nothing here runs: ``GenerationTrace.start`` returns None.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from broker import genai, telemetry
from broker.events import EventType
from broker.request.generation import GenerationRequest
from broker.streams.records import Claim

if TYPE_CHECKING:
    from opentelemetry.trace import Span

FIRST_TOKEN = "gen_ai.first_token"
FIRST_VISIBLE = "rsb.first_text_appended"
TERMINAL = "rsb.terminal_event_appended"


def operation(request: GenerationRequest) -> str:
    return genai.TEXT_COMPLETION if request.messages is None else genai.CHAT


def error_type(status: str, code: str) -> str:
    """A generation's ``error.type``: '' when it is done, ``cancelled`` (whatever the reason), else the code of its
    ``error`` event (``engine``, ``deadline``, ``worker_lost``...: docs/protocol.md)."""
    return "" if status == "done" else "cancelled" if status == "cancelled" else code


def _input_messages(request: GenerationRequest) -> str:
    if request.messages is None:
        return orjson.dumps([{"role": "user", "parts": [{"type": "text", "content": request.prompt or ""}]}]).decode()
    return orjson.dumps([{"role": m.role, "parts": [{"type": "text", "content": m.content}]}
                         for m in request.messages]).decode()


class GenerationTrace:
    """The spans of one attempt of a generation (see the module's docstring)."""

    __slots__ = ("_first_ns", "_handed_over", "_prefill", "_shown", "_start_ns", "_tracer", "append_max_s",
                 "append_s", "appends", "span")

    def __init__(self, tracer: Any, span: Span, start_ns: int, prefill: str) -> None:
        self._tracer = tracer
        self.span = span
        self._start_ns = start_ns
        self._prefill = prefill  # the first phase's name
        self._first_ns: int | None = None
        self._shown = False
        self._handed_over = False
        self.appends = 0
        self.append_s = 0.0
        self.append_max_s = 0.0

    @classmethod
    def start(cls, claim: Claim, response_model: str, worker_id: str, *, upstream: bool) -> GenerationTrace | None:
        """The spans of ``claim``'s attempt, begun now (None: tracing is off)."""
        tracer = telemetry.TRACER
        if tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        req = claim.request
        parent = telemetry.remote_parent(claim.trace)
        now = time.time_ns()
        job: dict[str, Any] = {genai.REQUEST_MODEL: claim.model, genai.RESPONSE_ID: str(claim.stream_id),
                               genai.TIER: claim.tier}
        if claim.attempts == 1 and claim.waited_s > 0:  # (no inference: no gen_ai.operation.name)
            waited = tracer.start_span("queue wait", context=parent, start_time=now - int(claim.waited_s * 1e9),
                                       attributes=job)
            waited.end(end_time=now)
        attributes = {**job, genai.OPERATION: operation(req), genai.PROVIDER: genai.PROVIDER_RSB,
                      genai.RESPONSE_MODEL: response_model, genai.MAX_TOKENS: req.max_tokens,
                      genai.TEMPERATURE: req.temperature, genai.TOP_P: req.top_p, genai.STREAM: True,
                      genai.ATTEMPT: claim.attempts, genai.CONTINUED_FROM: claim.seq, genai.WORKER: worker_id}
        if req.seed is not None:
            attributes[genai.SEED] = req.seed
        if req.history is not None and req.history.conversation is not None:
            attributes[genai.CONVERSATION] = str(req.history.conversation)
        if req.response_format is not None and req.response_format.type != "text":
            attributes[genai.OUTPUT_TYPE] = "json"
        if telemetry.CAPTURE_CONTENT:
            attributes[genai.INPUT_MESSAGES] = _input_messages(req)
        span = tracer.start_span(f"{operation(req)} {claim.model}", context=parent, kind=SpanKind.INTERNAL,
                                 start_time=now, attributes=attributes)
        return cls(tracer, span, now, "time to first token" if upstream else "prefill")

    def first_token(self) -> None:
        """The attempt's first token came: its prefill (or the upstream's time to first token) is over."""
        if self._first_ns is None:
            self._first_ns = time.time_ns()
            self.span.add_event(FIRST_TOKEN, timestamp=self._first_ns)

    def appended(self, seconds: float, events: Any) -> None:
        """One append of ``events`` ((type, data) pairs) landed after ``seconds``."""
        self.appends += 1
        self.append_s += seconds
        self.append_max_s = max(self.append_max_s, seconds)
        if self._first_ns is not None and not self._shown and any(etype == EventType.DELTA for etype, _ in events):
            self._shown = True  # the first text a reader can see: the answer's time to first token, as users see it
            self.span.add_event(FIRST_VISIBLE, {"rsb.append.seconds": round(seconds, 6)})

    async def finished(self, status: str, code: str, usage: dict[str, Any],
                       answer: Callable[[], Awaitable[Any]]) -> None:
        """The terminal event landed: ``status``, its finish reason, error code or cancel reason, the usage it
        recorded. Opted in (broker.telemetry.CAPTURE_CONTENT), the whole answer too: ``answer`` reads it back from
        the stream (earlier attempts' part included: a generator.answer.AnswerSoFar)."""
        span = self.span
        span.add_event(TERMINAL, {"rsb.status": status})
        span.set_attributes({genai.INPUT_TOKENS: int(usage.get("prompt_tokens") or 0),
                             genai.OUTPUT_TOKENS: int(usage.get("completion_tokens") or 0),
                             genai.CACHED_INPUT_TOKENS: int(usage.get("cached_tokens") or 0)})
        error = error_type(status, code)
        if not error:
            span.set_attribute(genai.FINISH_REASONS, [code])
        else:
            telemetry.mark_error(span, error)
            if status == "cancelled":
                span.set_attribute(genai.CANCEL_REASON, code)
        if telemetry.CAPTURE_CONTENT:
            with contextlib.suppress(Exception):  # best effort: the stream is finished and safe
                text = (await answer()).text
                span.set_attribute(genai.OUTPUT_MESSAGES, orjson.dumps([{
                    "role": "assistant", "parts": [{"type": "text", "content": text}],
                    "finish_reason": code if status == "done" else status}]).decode())

    def handed_over(self) -> None:
        """The attempt released its job for another worker to continue (a shutdown past its grace, a failover)."""
        self._handed_over = True

    def end(self, ending: str | None) -> None:
        """The attempt is over. ``ending``: why it stopped without a terminal event of its own (fenced out, handed
        over: generator.lease.Ending), None when it wrote one."""
        if ending is not None:
            telemetry.mark_error(self.span, "handed_over" if self._handed_over else ending)
        self.span.set_attributes({genai.APPENDS: self.appends, genai.APPEND_SECONDS: round(self.append_s, 6),
                                  genai.APPEND_MAX_SECONDS: round(self.append_max_s, 6)})
        # The phases are drawn now, from the times kept: an attempt that dies (SIGKILL) leaves no span behind whose
        # parent never comes; its continuation is the trace's next attempt.
        from opentelemetry.trace import set_span_in_context

        now = time.time_ns()
        under = set_span_in_context(self.span)
        first = self._first_ns if self._first_ns is not None else now
        self._tracer.start_span(self._prefill, context=under, start_time=self._start_ns).end(end_time=first)
        if self._first_ns is not None:
            self._tracer.start_span("decode", context=under, start_time=first).end(end_time=now)
        self.span.end(end_time=now)


@contextlib.contextmanager
def attempt(trace: GenerationTrace | None, unwritten: Callable[[], str | None]) -> Iterator[None]:
    """Around an attempt: its span current inside (its log lines, its upstream call's span), ended after, marked
    with ``unwritten()`` when the attempt ended without writing the stream's terminal event (another worker will)."""
    if trace is None:
        yield
        return
    try:
        with telemetry.current(trace.span):
            yield
    finally:
        trace.end(unwritten())


def upstream_span(protocol: str, url: str, model: str | None, *, chat: bool) -> Span | None:
    """The client span of a request to an upstream server (None: tracing off); ``headers_of(span)`` makes the
    upstream continue it. A child of the current span: the attempt's."""
    tracer = telemetry.TRACER
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    parts = urlsplit(url)
    op = genai.CHAT if chat else genai.TEXT_COMPLETION
    attributes: dict[str, Any] = {genai.OPERATION: op, genai.PROVIDER: protocol,
                                  genai.SERVER_ADDRESS: parts.hostname or "", genai.STREAM: True}
    if parts.port:
        attributes[genai.SERVER_PORT] = parts.port
    if model:
        attributes[genai.REQUEST_MODEL] = model
    return tracer.start_span(f"{op} {model or parts.hostname}", kind=SpanKind.CLIENT, attributes=attributes)


def upstream_headers(span: Span | None) -> dict[str, str] | None:
    """The headers that carry ``span``'s trace to the upstream (None: not traced)."""
    return None if span is None else telemetry.headers_of(span)


def end_upstream(span: Span | None, status_code: int | None, error: BaseException | None) -> None:
    if span is None:
        return
    if status_code is not None:
        span.set_attribute("http.response.status_code", status_code)
    if status_code is not None and status_code >= 400:  # the HTTP conventions' error.type: the status code
        telemetry.mark_error(span, str(status_code))
    elif error is not None and not isinstance(error, GeneratorExit | asyncio.CancelledError):  # rsb's own stop
        telemetry.mark_error(span, type(error).__qualname__)
    span.end()
