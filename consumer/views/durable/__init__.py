"""The Durable Streams view: the open protocol (github.com/durable-streams/durable-streams, PROTOCOL.md) at
``/v1/stream/{path}``, over Redis, on any number of stateless pods. docs/protocol.md describes it, what it
does not support and why; tests/durable/harness runs the protocol's own conformance suite against it.

- protocol.py: header names, request parsing, the cursor, the error boundary and the security headers;
- streams.py: streams that clients create and write (broker.durable.store holds every Redis step);
- live.py: long-poll and SSE over the pod's LiveHub (no Redis connection per waiting reader);
- generations.py: rsb's own generations, read-only, at ``/v1/stream/rsb/<stream id>``;
- responses.py: pages, 204s and SSE events on the wire, for both kinds of stream.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from broker.errors import NotFound
from consumer.state import state_of
from consumer.views.durable import generations, streams
from consumer.views.durable.protocol import METHODS, REQUEST_HEADERS, endpoint, respond, stream_path

# The protocol reserves this first segment (subscriptions, spec sections 6-7; not implemented).
_RESERVED = "__ds"
_HANDLERS = {"GET": streams.get, "HEAD": streams.head, "PUT": streams.put, "POST": streams.post,
             "DELETE": streams.delete}


def preflight(request: Request) -> Response:
    """A CORS preflight that reached the view, i.e. with no --cors-origins configured (else the app's CORS
    middleware answers it): what the protocol allows, but no Access-Control-Allow-Origin, so a browser on
    another origin is still refused until the operator allows it."""
    return respond(204, {"Access-Control-Allow-Methods": ", ".join(METHODS),
                         "Access-Control-Allow-Headers": ", ".join(REQUEST_HEADERS), "Access-Control-Max-Age": "600"})


async def dispatch(request: Request) -> Response:
    path = stream_path(request)
    first = path.split("/", 1)[0]
    if first == _RESERVED:
        raise NotFound("reserved path: subscriptions are not supported")
    if request.method == "OPTIONS":
        return preflight(request)
    state_of(request).metrics.ds_requests.labels(request.method).inc()
    if first == streams.GENERATIONS:
        return await generations.handle(request, path)
    return await _HANDLERS[request.method](request, path)


ROUTES = [Route("/v1/stream/{path:path}", endpoint(dispatch), methods=list(METHODS))]
