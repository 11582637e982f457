"""The paths of the native stream routes that the edge handles before the app's router does (the readers' front door,
the routes a read token opens), declared once: the router serves them (consumer.views.native) and the edge matches
them with Starlette's own compiler of a route's path, so there is one spelling of each."""

from __future__ import annotations

import re

from starlette.routing import compile_path

STREAM_ROUTE = "/v1/streams/{stream_id}"
EVENTS_ROUTE = "/v1/streams/{stream_id}/events"


def _matcher(route: str) -> re.Pattern[str]:
    return compile_path(route)[0]


#: ``match(path).group("stream_id")``: the stream a request to either route names.
STREAM_PATH, EVENTS_PATH = _matcher(STREAM_ROUTE), _matcher(EVENTS_ROUTE)
