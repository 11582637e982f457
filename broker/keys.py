"""Every Redis key rsb uses is named here, and only here.

All keys of one stream, and the job queue that stream is enqueued on, share the hash tag of the
stream's *partition* (``{p<n>}``). That keeps each atomic script (create + enqueue, claim, append,
finish, cancel) inside one hash slot, so the schema runs unchanged on Redis Cluster, while
``partitions`` spreads streams and queues over many slots and so over every master.

``partitions`` is part of the stored data's address: choose it once per deployment (1 is strict
first-come-first-served on one server; a cluster wants a few per master).

The hash tag of partition ``i`` of ``N`` is chosen so that the N tags' hash slots are spread evenly over
the 16384 slots: tag ``p<i>`` when its slot already falls in the middle half of the i-th N-th of the slot
space, else the first ``p<i>-<k>`` that does. Plain ``p0``..``pN-1`` would not do: CRC16 clusters them
(p0, p1 and p2 all land on the first two masters of a 3-master cluster). Redis Cluster (``redis-cli
--cluster create``, and managed offerings) gives each master a contiguous, equal share of the slots, so
evenly spaced slots put ``N / masters`` partitions on every master. Keeping each slot within the middle
half of its N-th leaves room for the boundaries to be off by a few slots. With ``N = 1`` the tag is
``p0``, whatever its slot. The mapping is a pure function of (i, N): every process agrees on it.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
import zlib
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

PREFIX = "rsb"
JOBS_GROUP = "generators"
# One channel for workers that want cancel requests without waiting for their next append.
_CONTROL = "ctl"


def partition_of(stream_id: uuid.UUID, partitions: int) -> int:
    """Map a stream to its partition; stable across processes and versions (CRC-32 of the UUID)."""
    return zlib.crc32(stream_id.bytes) % partitions


@functools.cache
def partition_tag(partition: int, partitions: int) -> str:
    """The hash tag (without braces) of partition ``partition`` of ``partitions``; see the module doc."""
    if not 0 <= partition < max(1, partitions):
        raise ValueError(f"partition {partition} out of range for {partitions} partitions")
    if partitions <= 1:
        return "p0"
    width = REDIS_CLUSTER_HASH_SLOTS / partitions
    lo, hi = partition * width + width / 4, (partition + 1) * width - width / 4
    candidate, k = f"p{partition}", 0
    # Each try lands in the window with probability 1/(2N): a few dozen CRC16s at most, once per process.
    while not lo <= key_slot(candidate.encode()) < hi:
        k += 1
        candidate = f"p{partition}-{k}"
    return candidate


def partition_slot(partition: int, partitions: int) -> int:
    """The Redis Cluster hash slot of every key of this partition."""
    return key_slot(partition_tag(partition, partitions).encode())


def _tag(partition: int, partitions: int) -> str:
    return f"{PREFIX}:{{{partition_tag(partition, partitions)}}}"


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """The keys of one stream. Build it from a validated UUID only: nothing a client typed reaches a key."""

    stream_id: uuid.UUID
    partition: int
    partitions: int = 1

    @classmethod
    def of(cls, stream_id: uuid.UUID, partitions: int) -> StreamKeys:
        return cls(stream_id, partition_of(stream_id, partitions), partitions)

    @property
    def _tag(self) -> str:
        return _tag(self.partition, self.partitions)

    @property
    def meta(self) -> str:
        """Hash: request, status, fence token, usage. See broker.scripts for its fields."""
        return f"{self._tag}:s:{self.stream_id}:meta"

    @property
    def events(self) -> str:
        """Redis Stream: the stream's events, in order; entry ids are the SSE event ids."""
        return f"{self._tag}:s:{self.stream_id}:events"

    @property
    def tombstone(self) -> str:
        """Tiny key left after retention so an expired stream answers 410, not 404."""
        return f"{self._tag}:s:{self.stream_id}:gone"

    @property
    def channel(self) -> str:
        """Pub/sub channel on which every appended event is also published, for live tailing."""
        return f"{self._tag}:s:{self.stream_id}:live"

    @property
    def jobs(self) -> str:
        return jobs_key(self.partition, self.partitions)

    @property
    def queue_stats(self) -> str:
        return queue_stats_key(self.partition, self.partitions)

    def tenant(self, principal: str) -> str:
        """Hash of one caller's counters in this partition: ``active`` (unfinished generations) and ``tat``
        (the create-rate limiter's theoretical arrival time, ms). ``principal`` comes from ``principal()``."""
        return f"{self._tag}:tenant:{principal or '-'}"

    @property
    def aborted(self) -> str:
        return aborted_log_key(self.partition, self.partitions)

    @property
    def aborted_totals(self) -> str:
        return aborted_totals_key(self.partition, self.partitions)

    @property
    def control(self) -> str:
        return control_channel(self.partition, self.partitions)


def principal(key_id: str, address: str) -> str:
    """Whom a create is charged to: the API key (ids are validated, ``[A-Za-z0-9_-]{1,64}``, when the keys
    file is loaded), else the client's address group, as ``a:`` and a digest: an address may come from a
    forwarded header, and nothing a client sent reaches a key name. Key ids hold no ``:``, so the two
    never meet."""
    if key_id:
        return key_id
    return "a:" + hashlib.blake2b(address.encode(), digest_size=12).hexdigest()


def jobs_key(partition: int, partitions: int) -> str:
    """Redis Stream of job entries (field ``sid``), read by the ``generators`` consumer group."""
    return f"{_tag(partition, partitions)}:jobs"


def queue_stats_key(partition: int, partitions: int) -> str:
    """Hash of queue counters for a partition: ``waiting`` (enqueued, not yet claimed)."""
    return f"{_tag(partition, partitions)}:qstats"


def stream_key_prefix(partition: int, partitions: int) -> str:
    """``<prefix><uuid>:meta`` / ``:events`` are a stream's keys: the claim script walks the waiting jobs
    of its partition (same slot) with it to update their queue positions."""
    return f"{_tag(partition, partitions)}:s:"


def control_channel(partition: int, partitions: int) -> str:
    """Pub/sub channel carrying cancel notices (payload: stream id) of one partition's streams to the
    workers. Per partition, in the partition's slot, so that on Redis Cluster the cancel script can
    SPUBLISH it from the stream's own shard instead of broadcasting over the whole cluster bus."""
    return f"{_tag(partition, partitions)}:{_CONTROL}:cancel"


def aborted_log_key(partition: int, partitions: int) -> str:
    """Redis Stream of aborted-generation records (one per partition, so ``finish`` can write it atomically)."""
    return f"{_tag(partition, partitions)}:aborted"


def aborted_totals_key(partition: int, partitions: int) -> str:
    """Hash of running totals of aborted generations, ``<reason>|<counter>`` fields, for /metrics."""
    return f"{_tag(partition, partitions)}:aborted_totals"


def chat_key(key_id: str, chat_id: str) -> str:
    """Hash of one chat's latest turn (``sid``: the turn's stream id, ``tk``: its turn key; see broker.chats),
    per API key: the key id is part of the name, so one tenant's chat id never names another's chat. The
    chat id is a client's string: only its digest reaches the key. It is a key of its own, in its own slot
    on Redis Cluster (no hash tag), apart from its turns' streams: no script touches both (broker.chats
    says how a turn stays atomic without that)."""
    digest = hashlib.sha256(chat_id.encode()).hexdigest()[:32]
    return f"{PREFIX}:chat:{key_id or '-'}:{digest}"


def served_models_key() -> str:
    """Sorted set: the name of each model a generator serves, scored by when (Unix ms) one last said so.
    One key for the deployment, outside every partition: only single-key commands touch it."""
    return f"{PREFIX}:models"


# -- Durable Streams (consumer/views/durable): streams named by clients, not by a UUID ----------------------


def durable_partition(name: str, partitions: int) -> int:
    """The partition of a Durable Stream, from its tenant-qualified name (CRC-32, like ``partition_of``)."""
    return zlib.crc32(name.encode()) % partitions


@dataclass(frozen=True, slots=True)
class DurableKeys:
    """The keys of one Durable Stream. ``name`` is tenant-qualified, ``<api key id>/<path>`` (``-`` for the
    anonymous key): each API key has its own namespace of paths. Only its SHA-256 reaches a key name, so
    nothing a client typed does. All keys share the partition's hash tag: every script of
    broker.durable_scripts runs in one slot."""

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
        return f"{_tag(self.partition, self.partitions)}:ds:{digest}"

    @property
    def meta(self) -> str:
        """Hash: content type, tail, closed, TTL/expiry, fork origin, ... (fields: broker.durable_scripts)."""
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
        return f"{_tag(self.partition, self.partitions)}:ds-tenant:{key_id}"

    @property
    def all(self) -> list[str]:
        """meta, data, producers, forks, tenant: the KEYS of most scripts."""
        return [self.meta, self.data, self.producers, self.forks, self.tenant]
