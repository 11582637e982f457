"""Per-pod admission limits on open SSE connections, per API key and per client address, and what an
address is: the group one client controls (an IPv4 address, an IPv6 /64), seen through trusted proxies.

Counted in this process: a pod's resources are what they protect (sockets, memory). Limits across pods
scale with the number of pods behind the balancer, which spreads each client's connections.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import Counter
from collections.abc import Iterable

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
