"""Every Redis key of Durable Streams (the open protocol served by consumer/views/durable: streams that clients
name and write, apart from rsb's generations), named here and only here. Their partitions share rsb's keyspace
(broker.redis.keyspace): a Durable Stream's keys and its tenant's set carry its partition's hash tag. Each kind of
key is one ``KeyTemplate`` (``SCHEMA`` lists them all), as rsb's own are (broker.streams.keys): ``DurableKeys``
builds every key from them, the scripts get them as KEYS (and the channel as an argument), never spelling one in
Lua, and tests/broker/test_key_schema.py holds every key a real Redis is left with to them."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

from broker.redis.keyspace import KeyTemplate, tagged

#: What all of one stream's keys start with: its partition's tag and its tenant-qualified name's digest.
DURABLE_STREAM = KeyTemplate("{tag}:ds:{digest}")
DURABLE_META = KeyTemplate.under("{stream}:m", stream=DURABLE_STREAM)
DURABLE_DATA = KeyTemplate.under("{stream}:d", stream=DURABLE_STREAM)
DURABLE_PRODUCERS = KeyTemplate.under("{stream}:p", stream=DURABLE_STREAM)
DURABLE_FORKS = KeyTemplate.under("{stream}:f", stream=DURABLE_STREAM)
DURABLE_CHANNEL = KeyTemplate.under("{stream}:live", stream=DURABLE_STREAM)
#: An API key's Durable Streams in one partition (``key``: the key id, ``-`` for the anonymous key).
DURABLE_TENANT = KeyTemplate("{tag}:ds-tenant:{key}")

#: Every kind of key of Durable Streams, by name (the key-schema test's).
SCHEMA: dict[str, KeyTemplate] = {n: v for n, v in globals().items() if isinstance(v, KeyTemplate)}


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
    def _tag(self) -> str:
        return tagged(self.partition, self.partitions)

    @property
    def _base(self) -> str:
        return DURABLE_STREAM.build(tag=self._tag, digest=hashlib.sha256(self.name.encode()).hexdigest()[:32])

    @property
    def meta(self) -> str:
        """Hash: content type, tail, closed, TTL/expiry, fork origin, ... (fields: broker.durable.scripts)."""
        return DURABLE_META.build(stream=self._base)

    @property
    def data(self) -> str:
        """Redis Stream: one entry per append (field ``b``: the bytes; JSON mode: items, one per line)."""
        return DURABLE_DATA.build(stream=self._base)

    @property
    def producers(self) -> str:
        """Hash: idempotent producer id -> ``<epoch> <last seq>``."""
        return DURABLE_PRODUCERS.build(stream=self._base)

    @property
    def forks(self) -> str:
        """Set: the names of the live forks created from this stream (they keep a deleted source soft-deleted)."""
        return DURABLE_FORKS.build(stream=self._base)

    @property
    def channel(self) -> str:
        """Pub/sub channel: every append, close and delete, to wake this stream's live readers."""
        return DURABLE_CHANNEL.build(stream=self._base)

    @property
    def tenant(self) -> str:
        """Sorted set of the API key's Durable Streams in this partition (member: meta key; score: expiry in ms,
        ``inf`` for none), for the per-key stream count; in the stream's slot, so a create checks and counts
        in one step."""
        return DURABLE_TENANT.build(tag=self._tag, key=self.name.partition("/")[0])

    @property
    def script_keys(self) -> dict[str, str]:
        """The KEYS of most scripts, by name (broker.durable.scripts.STREAM_KEYS)."""
        return {"meta": self.meta, "data": self.data, "producers": self.producers, "forks": self.forks,
                "tenant": self.tenant}
