"""Per-pod admission limits on open SSE connections, per API key and per client IP.

Counted in this process: a pod's resources are what they protect (sockets, memory). Limits across pods
scale with the number of pods behind the balancer, which spreads each client's connections.
"""

from __future__ import annotations

from collections import Counter

from broker.errors import TooManyConnections


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
