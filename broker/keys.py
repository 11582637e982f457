"""Every Redis key rsb uses is named here, and only here.

All keys of one stream, and the job queue that stream is enqueued on, share the hash tag of the
stream's *partition* (``{p<n>}``). That keeps each atomic script (create + enqueue, claim, append,
finish, cancel) inside one hash slot, so the schema runs unchanged on Redis Cluster, while
``partitions`` spreads streams and queues over many slots and so over every master.

``partitions`` is part of the stored data's address: choose it once per deployment (1 is strict
first-come-first-served on one server; a cluster wants a few per master).
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass

PREFIX = "rsb"
JOBS_GROUP = "generators"
# One channel for workers that want cancel requests without waiting for their next append.
_CONTROL = "ctl"


def partition_of(stream_id: uuid.UUID, partitions: int) -> int:
    """Map a stream to its partition; stable across processes and versions (CRC-32 of the UUID)."""
    return zlib.crc32(stream_id.bytes) % partitions


def _tag(partition: int) -> str:
    return f"{PREFIX}:{{p{partition}}}"


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """The keys of one stream. Build it from a validated UUID only: nothing a client typed reaches a key."""

    stream_id: uuid.UUID
    partition: int

    @classmethod
    def of(cls, stream_id: uuid.UUID, partitions: int) -> StreamKeys:
        return cls(stream_id, partition_of(stream_id, partitions))

    @property
    def meta(self) -> str:
        """Hash: request, status, fence token, usage. See broker.scripts for its fields."""
        return f"{_tag(self.partition)}:s:{self.stream_id}:meta"

    @property
    def events(self) -> str:
        """Redis Stream: the stream's events, in order; entry ids are the SSE event ids."""
        return f"{_tag(self.partition)}:s:{self.stream_id}:events"

    @property
    def tombstone(self) -> str:
        """Tiny key left after retention so an expired stream answers 410, not 404."""
        return f"{_tag(self.partition)}:s:{self.stream_id}:gone"

    @property
    def channel(self) -> str:
        """Pub/sub channel on which every appended event is also published, for live tailing."""
        return f"{_tag(self.partition)}:s:{self.stream_id}:live"

    @property
    def jobs(self) -> str:
        return jobs_key(self.partition)

    @property
    def queue_stats(self) -> str:
        return queue_stats_key(self.partition)

    @property
    def aborted(self) -> str:
        return aborted_log_key(self.partition)

    @property
    def aborted_totals(self) -> str:
        return aborted_totals_key(self.partition)


def jobs_key(partition: int) -> str:
    """Redis Stream of job entries (field ``sid``), read by the ``generators`` consumer group."""
    return f"{_tag(partition)}:jobs"


def queue_stats_key(partition: int) -> str:
    """Hash of queue counters for a partition: ``waiting`` (enqueued, not yet claimed)."""
    return f"{_tag(partition)}:qstats"


def stream_key_prefix(partition: int) -> str:
    """``<prefix><uuid>:meta`` / ``:events`` are a stream's keys: the claim script walks the waiting jobs
    of its partition (same slot) with it to update their queue positions."""
    return f"{_tag(partition)}:s:"


def control_channel() -> str:
    """Pub/sub channel carrying cancel notices (payload: stream id) to all workers."""
    return f"{PREFIX}:{_CONTROL}:cancel"


def aborted_log_key(partition: int) -> str:
    """Redis Stream of aborted-generation records (one per partition, so ``finish`` can write it atomically)."""
    return f"{_tag(partition)}:aborted"


def aborted_totals_key(partition: int) -> str:
    """Hash of running totals of aborted generations, ``<reason>|<counter>`` fields, for /metrics."""
    return f"{_tag(partition)}:aborted_totals"
