"""Webhooks: when a generation ends, one event is POSTed to its destination (``--webhook-url``, or its API key's
``webhook_url``), signed per Standard Webhooks, at least once, from the Redis outbox (broker.streams.outbox) that
the terminal event's own script fills.

Every consumer pod runs a Deliverer: it takes due events from each partition's outbox (a lease: no other pod takes
them meanwhile), POSTs each in a task of its own (at most MAX_IN_FLIGHT at once, a DELIVERY_TIMEOUT_S each, no
redirects followed), and marks it delivered on a 2xx, or due again after its backoff otherwise, for a day. It never
touches a stream: a slow or dead receiver delays only its own events. A pod SIGKILLed mid-delivery leaves its
events to the next pod that takes them once their lease is over (broker.streams.outbox.LEASE_MS).

Destinations are checked at start: http or https, and (unless ``--webhook-allow-private``) a host that resolves to
public addresses only, so a key's ``webhook_url`` cannot reach the deployment's own network (SSRF). Each delivery
checks its host's addresses again (a name may come to resolve elsewhere later); an address that turns private is a
failed try.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx

from broker.errors import StoreUnavailable
from broker.redis.connection import RedisClient
from broker.streams.outbox import HookEvent, Outbox
from consumer.metrics import Metrics

log = logging.getLogger("rsb.consumer")

SECRET_PREFIX = "whsec_"
#: One POST's bound: connecting, sending and the receiver's answer.
DELIVERY_TIMEOUT_S = 10.0
#: Deliveries one pod has in flight at most.
MAX_IN_FLIGHT = 32
#: How often a pod looks for due events (each partition).
POLL_S = 0.5


class WebhookRefused(ValueError):
    """A webhook destination or secret rsb will not use: the message is the one line to print at start."""


def parse_secret(secret: str) -> bytes:
    """The signing key of a ``whsec_<base64>`` secret (Standard Webhooks)."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise WebhookRefused("--webhook-secret must be whsec_ and base64 (as OpenAI and Standard Webhooks give "
                             "them)") from None
    if len(key) < 16:
        raise WebhookRefused("--webhook-secret is too short: at least 16 bytes of key, base64 after whsec_")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,`` and the base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(key: bytes, msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    ts = int(time.time() if now is None else now)
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sign(key, msg_id, ts, body),
            "content-type": "application/json", "user-agent": "rsb-webhooks"}


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
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


def signing_key(url: str | None, secret: str | None, key_urls: Iterable[str], *, allow_private: bool) -> bytes | None:
    """At start: the signing key when any webhook destination is configured (``url``: --webhook-url; ``key_urls``:
    the keys file's), every destination checked; None when there is none. Raises WebhookRefused."""
    urls = [u for u in (url, *key_urls) if u]
    if not urls:
        return None
    if not secret:
        raise WebhookRefused("webhooks need --webhook-secret (whsec_ and base64) to sign their events")
    key = parse_secret(secret)
    for u in dict.fromkeys(urls):
        check_destination(u, allow_private=allow_private)
    return key


class Deliverer:
    """Delivers this pod's share of the outbox until stopped (``run`` is the pod's task)."""

    def __init__(self, redis: RedisClient, partitions: int, secret: bytes, metrics: Metrics, *,
                 allow_private: bool = False, timeout_s: float = DELIVERY_TIMEOUT_S) -> None:
        self.outbox = Outbox(redis, partitions)
        self.partitions = partitions
        self.secret = secret
        self.metrics = metrics
        self.allow_private = allow_private
        self.http = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False,
                                      limits=httpx.Limits(max_connections=MAX_IN_FLIGHT))
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self._round()
                except StoreUnavailable:  # Redis away: the next round
                    pass
                except Exception as e:  # a bug: said, and tried again next round
                    log.error("taking webhook events failed: %s", type(e).__name__, exc_info=e)
                await asyncio.sleep(POLL_S)
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.http.aclose()

    async def _round(self) -> None:
        for p in range(self.partitions):
            free = MAX_IN_FLIGHT - len(self._tasks)
            if free <= 0:
                return
            for event in await self.outbox.take(p, int(time.time() * 1000), free):
                task = asyncio.create_task(self._deliver(event), name=f"webhook {event.id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _deliver(self, event: HookEvent) -> None:
        body = event.body()
        ok, why = False, ""
        try:
            await _check_at_delivery(event.url, self.allow_private)
            r = await self.http.post(event.url, content=body, headers=headers(self.secret, event.id, body))
            ok, why = 200 <= r.status_code < 300, f"HTTP {r.status_code}"
        except (httpx.HTTPError, OSError, WebhookRefused) as e:
            why = type(e).__name__ if not isinstance(e, WebhookRefused) else str(e)
        try:
            if ok:
                await self.outbox.done(event)
                self.metrics.webhooks_delivered.inc()
            elif await self.outbox.retry(event, int(time.time() * 1000)):
                self.metrics.webhooks_retried.inc()
                log.info("webhook not delivered; retried later", extra={"event": event.id, "why": why,
                                                                       "attempt": event.record.get("attempts", 0) + 1})
            else:
                self.metrics.webhooks_given_up.inc()
                log.warning("webhook given up after a day of tries", extra={"event": event.id, "why": why})
        except StoreUnavailable:  # Redis away: the lease runs out and the event is taken (and sent) again
            pass
        except Exception as e:
            log.error("recording a webhook delivery failed: %s", type(e).__name__, exc_info=e)
