"""Per-pod admission limits: open SSE connections per API key and per client address, what refused requests
cost their sender (``RefusalBudget``), and what an address is: the group one client controls (an IPv4 address, an
IPv6 /64), seen through trusted proxies.

Counted in this process: a pod's resources are what they protect (sockets, memory, its event loop). Limits across
pods scale with the number of pods behind the balancer, which spreads each client's connections.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable

from broker.errors import TooManyConnections

IPV6_GROUP_PREFIX = 64


@functools.lru_cache(maxsize=65536)
def address_group(host: str) -> str:
    """The address group a limit counts ``host`` in: an IPv4 address itself; an IPv6 address's /64 (a
    host is usually given a whole /64, and could otherwise take a new address per connection); an
    IPv4-mapped IPv6 address as its IPv4 address; anything else (a unix socket) as itself."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_GROUP_PREFIX), strict=False))
    return str(ip)


class TrustedProxies:
    """The peers whose forwarded header names the client (``--forwarded-allow-ips``: addresses, networks in
    CIDR, ``*``, or other literals such as a unix socket path), matched as uvicorn matches the same list
    when it rewrites the client address the app sees."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(entries)
        self.any = "*" in self.entries
        self.literals: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in self.entries:
            if entry == "*":
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.literals.add(entry)
        self._cache: dict[str, bool] = {}

    def __contains__(self, host: object) -> bool:
        if self.any:
            return True
        if not isinstance(host, str):
            return False
        known = self._cache.get(host)
        if known is None:
            known = self._match(host)
            if len(self._cache) < 65536:
                self._cache[host] = known
        return known

    def _match(self, host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host in self.literals
        return any(ip in net for net in self.networks)


class ConnectionLimiter:
    def __init__(self, per_ip: int) -> None:
        self.per_ip = per_ip
        self.by_ip: Counter[str] = Counter()
        self.by_key: Counter[str] = Counter()

    def acquire(self, ip: str, key_id: str, key_limit: int) -> None:
        """Count one more open stream, or raise TooManyConnections (429 + Retry-After)."""
        if self.per_ip and self.by_ip[ip] >= self.per_ip:
            raise TooManyConnections(f"too many open streams from this address (limit {self.per_ip})", 1)
        if key_limit and self.by_key[key_id] >= key_limit:
            raise TooManyConnections(f"too many open streams for this API key (limit {key_limit})", 1)
        self.by_ip[ip] += 1
        self.by_key[key_id] += 1

    def release(self, ip: str, key_id: str) -> None:
        for counter, k in ((self.by_ip, ip), (self.by_key, key_id)):
            counter[k] -= 1
            if counter[k] <= 0:
                del counter[k]


#: A refused request's cost: 1, and 1 more per this many body bytes the pod received (parsing is what it costs).
REFUSAL_BYTES_PER_UNIT = 64 * 1024


class RefusalBudget:
    """What refused requests (4xx) cost the address that sent them: a token bucket per address group, ``burst``
    units, refilled at ``rate_per_s``; each refusal takes 1 unit and 1 more per REFUSAL_BYTES_PER_UNIT of body
    received. While an address's bucket is empty its requests are refused before any work (429
    too_many_refusals, with the seconds until it holds a unit again), so a loop of invalid requests costs its
    sender, not the pod. Requests answered 2xx/3xx cost nothing. ``burst`` 0: no budget."""

    def __init__(self, burst: int, rate_per_s: float, *, max_senders: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = float(burst)
        self.rate_per_s = rate_per_s
        self.max_senders = max_senders
        self._clock = clock
        self._senders: dict[str, tuple[float, float]] = {}  # address group -> (units left, when)

    @property
    def enabled(self) -> bool:
        return self.burst > 0

    def _level(self, who: str, now: float) -> float:
        left, at = self._senders.get(who, (self.burst, now))
        return min(self.burst, left + (now - at) * self.rate_per_s)

    def retry_after_s(self, who: str) -> int | None:
        """None: ``who`` may send; else the seconds until its bucket holds a unit again."""
        if who not in self._senders:
            return None
        level = self._level(who, self._clock())
        if level > 0:
            return None
        return max(1, math.ceil((1 - level) / self.rate_per_s)) if self.rate_per_s > 0 else 3600

    def charge(self, who: str, body_bytes: int) -> None:
        """``who`` was refused a request whose body had ``body_bytes``."""
        now = self._clock()
        self._senders[who] = (self._level(who, now) - 1 - body_bytes // REFUSAL_BYTES_PER_UNIT, now)
        if len(self._senders) > self.max_senders:
            self._forget_whole(now)

    def _forget_whole(self, now: float) -> None:
        """Bounded memory: drop the senders whose bucket has refilled (they are as if never seen); if that is not
        enough, the oldest half."""
        self._senders = {w: v for w, v in self._senders.items() if self._level(w, now) < self.burst}
        if len(self._senders) > self.max_senders:
            keep = sorted(self._senders.items(), key=lambda item: item[1][1])[len(self._senders) // 2:]
            self._senders = dict(keep)
