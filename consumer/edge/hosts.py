"""The Host check of an open API (no ``--api-keys``): DNS rebinding.

A web page the user visits can point a name it controls at 127.0.0.1 and then drive an API on loopback from
its own origin (the browser thinks it is talking to the page's server, so the same-origin policy lets it read
the answers). Every such request carries the attacker's name in ``Host``. An open API therefore answers only
the names it is reached by legitimately: the loopback names, the address it listens on, and the operator's
``--allowed-hosts``; anything else is 421 ``host_not_allowed`` before any route runs. With API keys the page has
no key (the rsb page keeps its key in its own origin's storage), so the check is not needed.

A request with no Host header at all (HTTP/1.0) passes: no browser sends one without. The probes (/healthz,
/readyz) answer any Host: a kubelet or a load balancer names the pod by its address, and they reveal nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from broker.ascii import is_decimal
from broker.errors import HostNotAllowed
from consumer.edge.errors import error_response, status_of

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_HOST = "*"
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# Addresses that name every interface: what the server listens on, not a name a client can send.
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def host_name(header: str) -> str:
    """The name part of a Host header value, lowercased, without port, brackets or a final dot."""
    value = header.strip().lower()
    if value.startswith("["):  # [v6]:port
        return value[1:].partition("]")[0]
    name, sep, port = value.rpartition(":")
    if sep and is_decimal(port, max_digits=5) and ":" not in name:  # a bare IPv6 address has no port
        value = name
    return value.rstrip(".")


def allowed_names(bound_host: str, extra: Iterable[str]) -> frozenset[str] | None:
    """The Host names an open API answers (None: any)."""
    names = set(LOOPBACK_NAMES)
    if bound_host not in _WILDCARD_BINDS:
        names.add(host_name(bound_host))
    for raw in extra:
        if raw.strip() == ANY_HOST:
            return None
        names.add(host_name(raw))
    return frozenset(names)


class HostCheck:
    """``app`` behind the Host check; ``allowed`` None lets every Host through."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed is not None and scope["type"] == "http" and scope["path"] not in PROBE_PATHS:
            host = next((v for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and host_name(host.decode("latin-1")) not in self.allowed:
                err = HostNotAllowed()
                await error_response(status_of(err), err.code, err.message)(scope, receive, send)
                return
        await self.app(scope, receive, send)
