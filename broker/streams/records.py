"""What the store hands back: the records of a stream and of a claim, and the create quota. Plain
frozen values (no Redis here); broker.streams.stream_store and broker.streams.job_store read and write them."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.events import TERMINAL_TYPES, Event
from broker.redis.keyspace import partition_share
from broker.request.generation import GenerationRequest
from broker.streams.keys import QueueKeys, StreamKeys

STATUSES = ("queued", "running", "done", "cancelled", "error")
TERMINAL_STATUSES = TERMINAL_TYPES


@dataclass(frozen=True, slots=True)
class Quota:
    """What one tenant may have, checked and counted in the create's own atomic step. ``tenant`` is who is
    charged (broker.streams.keys.tenant_of: an API key or an address group; "" = the key id of the create).
    0 = no limit: ``max_active`` unfinished (queued or running) generations, ``burst`` creates at once
    refilled at ``rate_per_s``."""

    tenant: str = ""
    max_active: int = 0
    burst: int = 0
    rate_per_s: float = 0.0

    def share(self, partitions: int) -> tuple[int, int, int]:
        """(max_active, burst, interval_ms) of one partition. A caller's counters live in each partition's
        own slot, so that they are checked and counted in the create's one step on Redis Cluster too:
        each of P partitions allows ceil(limit / P) and the rate / P (exact with one partition, the
        default; with more, a caller whose creates happen to crowd one partition meets its share there a
        little before the whole)."""
        max_active = partition_share(self.max_active, partitions)
        if self.burst <= 0 or self.rate_per_s <= 0:
            return max_active, 0, 0
        return max_active, partition_share(self.burst, partitions), max(1, round(1000 * partitions / self.rate_per_s))


NO_QUOTA = Quota()


@dataclass(frozen=True, slots=True)
class Created:
    """A create that was accepted: ``created`` is False for a retry of an identical request (same id)."""

    created: bool
    status: str


class Unclaimable(enum.Enum):
    """Why a job has nothing left to run."""

    GONE = "the stream no longer exists"
    FINISHED = "the stream already ended"
    HELD = "the stream waits for its conversation's turn before it (broker.request.on_busy)"


@dataclass(frozen=True, slots=True)
class Claim:
    stream_id: uuid.UUID
    keys: StreamKeys
    fence: int
    attempts: int
    request: GenerationRequest
    cancel_reason: str
    model: str
    seq: int
    tier: str  # broker.request.tiers: the tier it was queued in
    # Whom the stream is charged to (broker.streams.keys.tenant_of: the API key id, or ``a:`` and a digest of
    # the client's address): the scheduler's fair-share unit, and the scope of what a worker caches for it.
    tenant: str = ""
    # From create to this claim (s), both the Redis server's time (CREATE, the claim): what a user waited, whatever
    # the pods' clocks say.
    waited_s: float = 0.0
    # The W3C traceparent of the create's span ('': not traced): this attempt's generation span is its child.
    trace: str = ""

    @property
    def queue(self) -> QueueKeys:
        """The queue its job is in: its model's, in its partition."""
        return self.keys.queue(self.model)


@dataclass(frozen=True, slots=True)
class StreamStatus:
    status: str
    model: str
    created_at: float
    usage: dict[str, Any] | None
    last_id: str | None
    cancel_on_disconnect: bool
    max_tokens: int
    key_id: str
    abandon_s: float = 0.0
    tier: str = ""  # broker.request.tiers: the tier it was queued in ('' for a stream from before tiers)
    #: A conversation's turn that waits for the turn before it to end (queued, in no line yet: broker.request.on_busy).
    held: bool = False

    @property
    def watched(self) -> bool:
        """Whether the generation depends on having readers (so pods must record that it has some)."""
        return self.status not in TERMINAL_STATUSES and (self.cancel_on_disconnect or self.abandon_s > 0)


@dataclass(frozen=True, slots=True)
class AppendResult:
    ok: bool
    cancel_reason: str
    seq: int | None = None  # the stored seq when the append was refused for a seq mismatch


@dataclass(frozen=True, slots=True)
class ReplayPage:
    """One read of a reader's range (``StreamStore.replay``): the events after its point; or, when its point is no
    longer in the stream (the reset rule: consumer.streaming.reader), ``reset`` and the newest event the stream still
    has at or before it (``common``, None for none), after which the reader starts again."""

    events: Sequence[Event]
    reset: bool = False
    common: str | None = None


def empty_usage() -> dict[str, Any]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "ttft_ms": None, "tpot_ms": None}
