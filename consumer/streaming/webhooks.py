"""Webhooks: when a generation ends, one event is POSTed to its destination (``--webhook-url``, or its API key's
``webhook_url``), signed per Standard Webhooks (with its key's ``webhook_secret``, else ``--webhook-secret``), at
least once, from the Redis outbox (broker.streams.outbox) that the terminal event's own script fills.

Every consumer pod runs a Deliverer: it takes due events from each partition's outbox (a lease: no other pod takes
them meanwhile), POSTs each in a task of its own, no redirects followed, and marks it delivered on a 2xx, or due
again after its backoff otherwise, for a day. Fair across destinations, so that one receiver that never answers (a
tarpit) holds up only its own events: at most PER_DESTINATION deliveries in flight per destination per pod (of
MAX_IN_FLIGHT), a short connect timeout, and a circuit breaker shared by every pod through the outbox: past a few
failures in a row a destination is held (none of its events taken) for a hold that doubles, then probed with one
event. It never touches a stream. A pod SIGKILLed mid-delivery leaves its events to the next pod that takes them
once their lease is over (broker.streams.outbox.LEASE_MS).

Destinations are checked at start: http or https, and (unless ``--webhook-allow-private``) a host that resolves to
public addresses only, so a key's ``webhook_url`` cannot reach the deployment's own network (SSRF): an IPv6 address
that embeds an IPv4 one (mapped, compatible, NAT64, 6to4, Teredo, ISATAP, SIIT) is judged by that IPv4 address too.
Each delivery checks its host's addresses again (a name may come to resolve elsewhere later); an address that turns
private is a failed try.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import hmac
import ipaddress
import logging
import socket
import time
from collections import Counter
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx

from broker.errors import StoreUnavailable
from broker.redis.connection import RedisClient
from broker.storage import one_round
from broker.streams.outbox import HookEvent, Outbox
from consumer.edge.auth import ApiKeys
from consumer.edge.errors import OUT_OF_MEMORY
from consumer.metrics import Metrics

log = logging.getLogger("rsb.consumer")

SECRET_PREFIX = "whsec_"
#: One POST's bound: connecting, sending and the receiver's answer.
DELIVERY_TIMEOUT_S = 10.0
#: Connecting alone: a receiver that never accepts costs its slot this long, not the whole timeout.
CONNECT_TIMEOUT_S = 2.0
#: Deliveries one pod has in flight at most, in all and to one destination (its scheme, host and port).
MAX_IN_FLIGHT = 256
PER_DESTINATION = 8
#: How often a pod looks for due events (each partition).
POLL_S = 0.5


class WebhookRefused(ValueError):
    """A webhook destination or secret rsb will not use: the message is the one line to print at start."""


def parse_secret(secret: str, what: str = "--webhook-secret") -> bytes:
    """The signing key of a ``whsec_<base64>`` secret (Standard Webhooks); ``what`` names it in a refusal."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise WebhookRefused(f"{what} must be whsec_ and base64 (as OpenAI and Standard Webhooks give them)") from None
    if len(key) < 16:
        raise WebhookRefused(f"{what} is too short: at least 16 bytes of key, base64 after whsec_")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,`` and the base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(key: bytes, msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    # The one pod clock rsb sends out, on purpose: Standard Webhooks' timestamp says when this attempt was signed,
    # and only the receiver checks it, against its own clock and with minutes of tolerance (replay protection).
    # No rsb process compares it, so the Redis server's clock is no nearer the receiver's than the sending pod's;
    # what the event says happened (its body's created_at) is the server's.
    ts = int(time.time() if now is None else now)
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sign(key, msg_id, ts, body),
            "content-type": "application/json", "user-agent": "rsb-webhooks"}


# IPv6 prefixes whose addresses carry an IPv4 address in their last 32 bits: IPv4-compatible (::/96, deprecated),
# SIIT's IPv4-translated (::ffff:0:0:0/96) and NAT64's well-known prefix (64:ff9b::/96, RFC 6052). IPv4-mapped,
# 6to4 and Teredo have ipaddress's own accessors; ISATAP marks its interface id.
_LAST_32 = tuple(ipaddress.IPv6Network(n) for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b::/96"))
# Never public, whatever they embed: NAT64's local-use prefix (RFC 8215) translates into a network of the operator's.
_LOCAL_ONLY = (ipaddress.IPv6Network("64:ff9b:1::/48"),)
_ISATAP_IDS = (0x00005EFE, 0x02005EFE)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address reaches through a translation or tunnel it names."""
    out: list[ipaddress.IPv4Address] = []
    if ip.ipv4_mapped is not None:
        out.append(ip.ipv4_mapped)
    if any(ip in net for net in _LAST_32) or (int(ip) >> 32) & 0xFFFFFFFF in _ISATAP_IDS:
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip.sixtofour is not None:
        out.append(ip.sixtofour)
    if ip.teredo is not None:
        out.extend(ip.teredo)  # the relay server's and the client's (obfuscated in the address, decoded here)
    return out


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in net for net in _LOCAL_ONLY):
            return False
        embedded = _embedded_ipv4(ip)
        if embedded:
            return all(v4.is_global and not v4.is_multicast for v4 in embedded)
    return ip.is_global and not ip.is_multicast


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused(f"webhook URL {url!r}: use an http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise WebhookRefused(f"webhook URL {url!r}: its port is not a number") from None
    return parts.hostname, port


def _refuse_private(url: str, addresses: Iterable[str]) -> None:
    private = sorted({a for a in addresses if not _is_public(a)})
    if private:
        raise WebhookRefused(f"webhook URL {url!r} reaches a private or loopback address ({', '.join(private)}): "
                             "refused against SSRF; pass --webhook-allow-private if it is meant")


def check_destination(url: str, *, allow_private: bool) -> None:
    """At start: raise WebhookRefused for a URL rsb will not POST to (see the module doc)."""
    host, port = _host_port(url)
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise WebhookRefused(f"webhook URL {url!r}: its host does not resolve ({e.strerror})") from None
    _refuse_private(url, (str(i[4][0]) for i in infos))


async def _check_at_delivery(url: str, allow_private: bool) -> None:
    host, port = _host_port(url)
    if allow_private:
        return
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    _refuse_private(url, (str(i[4][0]) for i in infos))


class Signing:
    """The key that signs each event: its API key's ``webhook_secret``, else --webhook-secret's (``default``)."""

    def __init__(self, default: bytes | None, by_key: dict[str, bytes]) -> None:
        self.default = default
        self.by_key = by_key

    def key_for(self, key_id: str) -> bytes | None:
        return self.by_key.get(key_id, self.default)


def signing(url: str | None, secret: str | None, keys: ApiKeys, *, allow_private: bool) -> Signing | None:
    """At start: how events are signed when any webhook destination is configured (``url``: --webhook-url; the keys
    file's ``webhook_url``), every destination checked; None when there is none. Every event needs a secret: its
    key's ``webhook_secret``, or --webhook-secret. Raises WebhookRefused."""
    entries = keys.all()
    urls = [u for u in (url, *(k.webhook_url for k in entries)) if u]
    if not urls:
        return None
    by_key = {k.id: parse_secret(k.webhook_secret, f"api key {k.id}: 'webhook_secret'")
              for k in entries if k.webhook_secret}
    # Who falls back on --webhook-secret: the keys (or, without keys, the callers) whose events have a destination.
    unsigned = [k.id for k in entries if (k.webhook_url or url) and k.id not in by_key]
    if not secret and (unsigned or (url and not entries)):
        who = f" (api key {unsigned[0]} has no 'webhook_secret')" if unsigned else ""
        raise WebhookRefused(f"webhooks need --webhook-secret (whsec_ and base64) to sign their events{who}")
    for u in dict.fromkeys(urls):
        check_destination(u, allow_private=allow_private)
    return Signing(parse_secret(secret) if secret else None, by_key)


class Deliverer:
    """Delivers this pod's share of the outbox until stopped (``run`` is the pod's task)."""

    def __init__(self, redis: RedisClient, partitions: int, signing: Signing, metrics: Metrics, *,
                 allow_private: bool = False, timeout_s: float = DELIVERY_TIMEOUT_S,
                 per_destination: int = PER_DESTINATION, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.outbox = Outbox(redis, partitions)
        self.partitions = partitions
        self.signing = signing
        self.metrics = metrics
        self.allow_private = allow_private
        self.per_destination = per_destination
        self.max_in_flight = max_in_flight
        # A receiver that accepts and never answers costs its own slots for timeout_s; one that never accepts costs
        # CONNECT_TIMEOUT_S.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)),
                                      follow_redirects=False, limits=httpx.Limits(max_connections=max_in_flight))
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy: Counter[str] = Counter()  # destination -> deliveries in flight from this pod

    async def run(self) -> None:
        try:
            while True:
                with one_round(log, "taking webhook events", OUT_OF_MEMORY):
                    await self._round()
                await asyncio.sleep(POLL_S)
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.http.aclose()

    async def _round(self) -> None:
        for p in range(self.partitions):
            free = self.max_in_flight - len(self._tasks)
            if free <= 0:
                return
            for event in await self.outbox.take(p, free, self.per_destination,
                                                dict(self._busy)):
                self._busy[event.dest] += 1
                task = asyncio.create_task(self._deliver(event), name=f"webhook {event.id}")
                self._tasks.add(task)
                task.add_done_callback(functools.partial(self._finished, dest=event.dest))

    def _finished(self, task: asyncio.Task[None], dest: str) -> None:
        self._tasks.discard(task)
        self._busy[dest] -= 1
        if self._busy[dest] <= 0:
            del self._busy[dest]

    async def _deliver(self, event: HookEvent) -> None:
        body = event.body()
        ok, why = False, ""
        key = self.signing.key_for(event.key)
        try:
            if key is None:  # a key removed from the keys file, and no --webhook-secret: nothing may sign it
                await self.outbox.done(event, delivered=False)
                self.metrics.webhooks_given_up.inc()
                log.warning("webhook given up: no secret signs it", extra={"event": event.id, "key_id": event.key})
                return
            await _check_at_delivery(event.url, self.allow_private)
            r = await self.http.post(event.url, content=body, headers=headers(key, event.id, body))
            ok, why = 200 <= r.status_code < 300, f"HTTP {r.status_code}"
        except (httpx.HTTPError, OSError, WebhookRefused) as e:
            why = type(e).__name__ if not isinstance(e, WebhookRefused) else str(e)
        except StoreUnavailable:
            return
        # Redis away or full: the lease runs out and the event is taken (and sent) again.
        with one_round(log, "recording a webhook delivery", OUT_OF_MEMORY):
            if ok:
                await self.outbox.done(event, delivered=True)
                self.metrics.webhooks_delivered.inc()
            elif await self.outbox.retry(event):
                self.metrics.webhooks_retried.inc()
                log.info("webhook not delivered; retried later", extra={"event": event.id, "why": why,
                                                                       "attempt": event.record.get("attempts", 0) + 1})
            else:
                self.metrics.webhooks_given_up.inc()
                log.warning("webhook given up after a day of tries", extra={"event": event.id, "why": why})
