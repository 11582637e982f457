"""A read's span: ``fetch_response``, the GenAI conventions' operation for fetching a response without inference.

One per read of a stream's events (a resume, a replay, a live tail, a view waiting for the end), whatever the view.
It is the child of the read's own request span (its own trace, or its client's) and links to the span of the create
whose generation it reads, so a trace viewer leads from the read to the generation and back. It carries where the
read resumed and how many events it served; no token usage (it computed none) and no text.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from broker import genai, telemetry
from broker.events import Event
from broker.genai import EVENTS_SERVED
from broker.streams.stream_store import StreamStore

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["EVENTS_SERVED", "batch_size", "one", "read_span", "traced"]

T = TypeVar("T")


def read_span(stream_id: uuid.UUID, after_id: str | None, tp: str, model: str) -> Span:
    """The span of a read of ``stream_id`` after ``after_id`` (None: from the start), linked to the create's span
    ``tp`` (its stored traceparent; '' leaves it unlinked); ``model``: the stream's. Tracing must be on."""
    tracer = telemetry.TRACER
    assert tracer is not None
    attributes: dict[str, Any] = {genai.OPERATION: genai.FETCH_RESPONSE, genai.PROVIDER: genai.PROVIDER_RSB,
                                  genai.RESPONSE_ID: str(stream_id)}
    if model:
        attributes[genai.REQUEST_MODEL] = model
    if after_id is not None:
        attributes[genai.RESUME_FROM] = after_id
    name = f"{genai.FETCH_RESPONSE} {model}" if model else genai.FETCH_RESPONSE
    return tracer.start_span(name, attributes=attributes, links=telemetry.link_to(tp))


def batch_size(batch: Sequence[Event] | None) -> int:
    return len(batch) if batch else 0


def one(event: Event | None) -> int:
    return 0 if event is None else 1


async def traced(store: StreamStore, stream_id: uuid.UUID, after_id: str | None, source: AsyncIterator[T],
                 size: Callable[[T], int]) -> AsyncGenerator[T, None]:
    """``source``, a read of the stream, inside its ``fetch_response`` span (tracing on: consumer.edge.tracing's
    request span its parent), linked to the span of the create whose generation it reads, with the resume
    point and the events served (``size`` of each item)."""
    try:
        tp, model = await store.trace_of(stream_id)
    except Exception:  # Redis away: the read meets it too, and says so; the span goes without its link
        tp = model = ""
    span = read_span(stream_id, after_id, tp, model)
    served = 0
    try:
        async for item in source:
            served += size(item)
            yield item
    except Exception as e:
        telemetry.mark_error(span, type(e).__qualname__)
        raise
    finally:
        span.set_attribute(EVENTS_SERVED, served)
        span.end()
        await cast(AsyncGenerator[T, None], source).aclose()
