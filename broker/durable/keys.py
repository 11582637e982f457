"""Every Redis key of Durable Streams (the open protocol served by consumer/views/durable: streams that clients
name and write, apart from rsb's generations), named here and only here. Their partitions share rsb's keyspace
(broker.redis.keyspace): a Durable Stream's keys and its tenant's set carry its partition's hash tag."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

from broker.redis.keyspace import tagged


def durable_partition(name: str, partitions: int) -> int:
    """The partition of a Durable Stream, from its tenant-qualified name (CRC-32, like ``partition_of``)."""
    return zlib.crc32(name.encode()) % partitions


@dataclass(frozen=True, slots=True)
class DurableKeys:
    """The keys of one Durable Stream. ``name`` is tenant-qualified, ``<api key id>/<path>`` (``-`` for the
    anonymous key): each API key has its own namespace of paths. Only its SHA-256 reaches a key name, so
    nothing a client typed does. All keys share the partition's hash tag: every script of
    broker.durable.scripts runs in one slot."""

    name: str
    partition: int
    partitions: int = 1

    @classmethod
    def of(cls, key_id: str, path: str, partitions: int) -> DurableKeys:
        return cls.named(f"{key_id or '-'}/{path}", partitions)

    @classmethod
    def named(cls, name: str, partitions: int) -> DurableKeys:
        """From a qualified name as stored (a fork's source, a source's forks)."""
        return cls(name, durable_partition(name, partitions), partitions)

    @property
    def path(self) -> str:
        return self.name.partition("/")[2]

    @property
    def _base(self) -> str:
        digest = hashlib.sha256(self.name.encode()).hexdigest()[:32]
        return f"{tagged(self.partition, self.partitions)}:ds:{digest}"

    @property
    def meta(self) -> str:
        """Hash: content type, tail, closed, TTL/expiry, fork origin, ... (fields: broker.durable.scripts)."""
        return f"{self._base}:m"

    @property
    def data(self) -> str:
        """Redis Stream: one entry per append (field ``b``: the bytes; JSON mode: items, one per line)."""
        return f"{self._base}:d"

    @property
    def producers(self) -> str:
        """Hash: idempotent producer id -> ``<epoch> <last seq>``."""
        return f"{self._base}:p"

    @property
    def forks(self) -> str:
        """Set: the names of the live forks created from this stream (they keep a deleted source soft-deleted)."""
        return f"{self._base}:f"

    @property
    def channel(self) -> str:
        """Pub/sub channel: every append, close and delete, to wake this stream's live readers."""
        return f"{self._base}:live"

    @property
    def tenant(self) -> str:
        """Sorted set of the API key's Durable Streams in this partition (member: meta key; score: expiry in ms,
        ``inf`` for none), for the per-key stream count; in the stream's slot, so a create checks and counts
        in one step."""
        key_id = self.name.partition("/")[0]
        return f"{tagged(self.partition, self.partitions)}:ds-tenant:{key_id}"

    @property
    def script_keys(self) -> dict[str, str]:
        """The KEYS of most scripts, by name (broker.durable.scripts.STREAM_KEYS)."""
        return {"meta": self.meta, "data": self.data, "producers": self.producers, "forks": self.forks,
                "tenant": self.tenant}
