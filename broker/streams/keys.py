"""Every Redis key of rsb's streams, jobs and chats is named here, and only here (Durable Streams' keys:
broker.durable.keys; a caller's storage quota: broker.redis.quota; the prefix and the partitions' hash tags:
broker.redis.keyspace). Each kind of key is one ``KeyTemplate`` (``SCHEMA`` lists them all): Python builds keys from
it, and the scripts that name keys inside Lua (the queue's lines, rings, inboxes from a stream's ``qp``...) get
builders generated from it (``lua_builders``): no script spells a key (tests/broker/test_key_schema.py holds both).

All keys of one stream, and the job queues that stream is enqueued on (one per model: ``QueueKeys``), share
the hash tag of the stream's *partition* (``{p<n>}``). That keeps each atomic script (create + enqueue, claim,
append, finish, cancel) inside one hash slot, so the schema runs unchanged on Redis Cluster, while
``partitions`` spreads streams and queues over many slots and so over every master. ``partitions`` is part of the
stored data's address: choose it once per deployment (1 is strict first-come-first-served on one server; a cluster
wants a few per master).
"""

from __future__ import annotations

import hashlib
import uuid
import zlib
from dataclasses import dataclass

from broker.redis.keyspace import PREFIX, KeyTemplate, tagged

_TENANT_INFIX = ":tenant:"

#: A stream's keys (the claim script names those of the streams waiting behind the one it claims: their positions).
STREAM_PREFIX = KeyTemplate("{tag}:s:")
STREAM_META = KeyTemplate.under("{streams}{sid}:meta", streams=STREAM_PREFIX)
STREAM_EVENTS = KeyTemplate.under("{streams}{sid}:events", streams=STREAM_PREFIX)
STREAM_TOMBSTONE = KeyTemplate.under("{streams}{sid}:gone", streams=STREAM_PREFIX)
STREAM_CHANNEL = KeyTemplate.under("{streams}{sid}:live", streams=STREAM_PREFIX)
TENANT = KeyTemplate("{tag}" + _TENANT_INFIX + "{tenant}")
AFFINITIES = KeyTemplate("{tag}:aff:")
AFFINITY = KeyTemplate.under("{affinities}{affinity}", affinities=AFFINITIES)
QUEUE_TOTALS = KeyTemplate("{tag}:qstats")
#: One channel per partition for workers that want cancel requests without waiting for their next append.
CONTROL = KeyTemplate("{tag}:ctl:cancel")
ABORTED_LOG = KeyTemplate("{tag}:aborted")
ABORTED_TOTALS = KeyTemplate("{tag}:aborted_totals")
USAGE_PREFIX = KeyTemplate("{tag}:usage:")
USAGE_LOG = KeyTemplate.under("{usage}{key}", usage=USAGE_PREFIX)
USAGE_FREE = KeyTemplate.under("{usage}free:{key}", usage=USAGE_PREFIX)
USAGE_DAY = KeyTemplate.under("{usage}day:{key}:{day}", usage=USAGE_PREFIX)
USAGE_ROLLUPS_SINCE = KeyTemplate("{tag}:usage-rollups-since")
USAGE_INDEX = KeyTemplate("{tag}:usage-keys")
OUTBOX = KeyTemplate("{tag}:hooks")
OUTBOX_DEST = KeyTemplate.under("{outbox}:d:{dest}", outbox=OUTBOX)
OUTBOX_DESTS = KeyTemplate("{tag}:hooks:dests")
OUTBOX_HOLDS = KeyTemplate("{tag}:hooks:holds")
OUTBOX_DUE = KeyTemplate("{tag}:hooks:due")
BUDGET = KeyTemplate("{tag}:budget:{key}:{period}")
CONVERSATION_META = KeyTemplate("{tag}:c:{digest}:meta")
CONVERSATION_TURNS = KeyTemplate("{tag}:c:{digest}:turns")
CONVERSATION_OWNER = KeyTemplate("{tag}:cs:{tenant}")
SERVED_MODELS = KeyTemplate(PREFIX + ":models")
SERVED_WORKERS = KeyTemplate(PREFIX + ":models:workers")
READ_TOKEN_SECRET = KeyTemplate(PREFIX + ":read-token-secret")
TOKEN_COUNTS = KeyTemplate(PREFIX + ":tc:{model}")
TOKEN_COUNT_QUESTIONS = KeyTemplate.under("{counts}:q", counts=TOKEN_COUNTS)
TOKEN_COUNT_LIVE = KeyTemplate.under("{counts}:live", counts=TOKEN_COUNTS)
TOKEN_COUNT_QUESTION = KeyTemplate(PREFIX + ":tc:ask:{question}")
TOKEN_COUNT_ANSWER = KeyTemplate(PREFIX + ":tc:ans:{question}")
#: A model's queue in one partition: ``qp`` is the prefix, which a stream's meta stores so its scripts reach the queue.
QUEUE_PREFIX = KeyTemplate("{tag}:q:{model}:")
QUEUE_STATS = KeyTemplate.under("{qp}stats", qp=QUEUE_PREFIX)
QUEUE_BACKLOG = KeyTemplate.under("{qp}jobs", qp=QUEUE_PREFIX)
QUEUE_LEASES = KeyTemplate.under("{qp}leases", qp=QUEUE_PREFIX)
QUEUE_DEFERRED = KeyTemplate.under("{qp}deferred", qp=QUEUE_PREFIX)
QUEUE_WAKE = KeyTemplate.under("{qp}wake", qp=QUEUE_PREFIX)
QUEUE_WAKE_FOR = KeyTemplate.under("{qp}wake:{worker}", qp=QUEUE_PREFIX)
QUEUE_INBOX = KeyTemplate.under("{qp}inbox:{worker}", qp=QUEUE_PREFIX)
QUEUE_RECEIPT = KeyTemplate.under("{qp}receipt:{worker}", qp=QUEUE_PREFIX)
#: List: the tenants with queued jobs in one tier, in turn order (round robin). Only the queue's scripts name it.
QUEUE_RING = KeyTemplate.under("{qp}ring:{tier}", qp=QUEUE_PREFIX)
#: List: one tenant's (``tenant_of()``'s) queued jobs in one tier, in order. Only the queue's scripts name it.
QUEUE_WAITING = KeyTemplate.under("{qp}w:{tier}:{who}", qp=QUEUE_PREFIX)

#: Every kind of key of rsb's streams, jobs and chats (pub/sub channels too: they follow the keys' rules).
SCHEMA: dict[str, KeyTemplate] = {n: v for n, v in globals().items() if isinstance(v, KeyTemplate)}


def partition_of(stream_id: uuid.UUID, partitions: int) -> int:
    """Map a stream to its partition; stable across processes and versions (CRC-32 of the UUID)."""
    return zlib.crc32(stream_id.bytes) % partitions


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
        return tagged(self.partition, self.partitions)

    @property
    def _prefix(self) -> str:
        return stream_key_prefix(self.partition, self.partitions)

    @property
    def meta(self) -> str:
        """Hash: request, status, fence token, usage. See broker.streams.scripts for its fields."""
        return STREAM_META.build(streams=self._prefix, sid=str(self.stream_id))

    @property
    def events(self) -> str:
        """Redis Stream: the stream's events, in order; entry ids are the SSE event ids."""
        return STREAM_EVENTS.build(streams=self._prefix, sid=str(self.stream_id))

    @property
    def tombstone(self) -> str:
        """Tiny key left after retention so an expired stream answers 410, not 404."""
        return STREAM_TOMBSTONE.build(streams=self._prefix, sid=str(self.stream_id))

    @property
    def channel(self) -> str:
        """Pub/sub channel on which every appended event is also published, for live tailing."""
        return STREAM_CHANNEL.build(streams=self._prefix, sid=str(self.stream_id))

    @property
    def queue_stats(self) -> str:
        return queue_stats_key(self.partition, self.partitions)

    def queue(self, model: str) -> QueueKeys:
        """The job queue of ``model`` (a served model's name) in this stream's partition."""
        return QueueKeys(self.partition, self.partitions, model)

    def tenant_counters(self, tenant: str) -> str:
        """Hash of one tenant's counters in this partition: ``active`` (unfinished generations) and ``tat``
        (the create-rate limiter's theoretical arrival time, ms), named in a stream's meta ``tenant``."""
        return TENANT.build(tag=self._tag, tenant=tenant or "-")

    def tenant_from_counters(self, counters_key: str) -> str:
        """The tenant a ``tenant_counters()`` key names ('' for none)."""
        _, found, name = counters_key.rpartition(_TENANT_INFIX)
        return name if found and name != "-" else ""

    @property
    def usage_index(self) -> str:
        return usage_index_key(self.partition, self.partitions)

    @property
    def outbox(self) -> str:
        return outbox_key(self.partition, self.partitions)

    @property
    def outbox_dests(self) -> str:
        return outbox_dests_key(self.partition, self.partitions)

    @property
    def outbox_holds(self) -> str:
        return outbox_holds_key(self.partition, self.partitions)

    @property
    def usage_prefix(self) -> str:
        return usage_log_prefix(self.partition, self.partitions)

    @property
    def usage_rollups_since(self) -> str:
        return usage_rollups_since_key(self.partition, self.partitions)

    @property
    def aborted_totals(self) -> str:
        return aborted_totals_key(self.partition, self.partitions)

    @property
    def control(self) -> str:
        return control_channel(self.partition, self.partitions)


def tenant_of(key_id: str, address: str) -> str:
    """The tenant, whom a create is charged to: the API key (ids are validated, ``[A-Za-z0-9_][A-Za-z0-9_-]{0,63}``,
    when the keys file is loaded: never ``-``, the keyless share's name in keys below), else the client's address
    group, as ``a:`` and a digest: an address may come from a forwarded header, and nothing a client sent reaches a
    key name. Key ids hold no ``:``, so the two never meet."""
    if key_id:
        return key_id
    return "a:" + hashlib.blake2b(address.encode(), digest_size=12).hexdigest()


def affinity_key(partition: int, partitions: int, affinity: str) -> str:
    """String: the worker that last ran a chat (``affinity``: a digest, GenerationRequest.affinity), so its
    next turn goes there (chat-affine claiming: broker.streams.queue_scripts)."""
    return AFFINITY.build(affinities=AFFINITIES.build(tag=tagged(partition, partitions)), affinity=affinity)


def queue_stats_key(partition: int, partitions: int) -> str:
    """Hash of a partition's queue counter over every model: ``waiting`` (enqueued, not yet claimed). Each
    model's queue has its own (``QueueKeys.stats``)."""
    return QUEUE_TOTALS.build(tag=tagged(partition, partitions))


def stream_key_prefix(partition: int, partitions: int) -> str:
    """``<prefix><uuid><suffix>`` are a stream's keys: the claim script walks the waiting jobs of its partition
    (same slot) from it, with the Lua builders of ``STREAM_META`` and ``STREAM_EVENTS``, to update their places."""
    return STREAM_PREFIX.build(tag=tagged(partition, partitions))


def control_channel(partition: int, partitions: int) -> str:
    """Pub/sub channel carrying cancel notices (payload: stream id) of one partition's streams to the
    workers. Per partition, in the partition's slot, so that on Redis Cluster the cancel script can
    SPUBLISH it from the stream's own shard instead of broadcasting over the whole cluster bus."""
    return CONTROL.build(tag=tagged(partition, partitions))


def aborted_log_key(partition: int, partitions: int) -> str:
    """Redis Stream of the aborted-generation records written before the usage ledger held them (read by the
    aborted report, never written any more: the report is a view of the ledger)."""
    return ABORTED_LOG.build(tag=tagged(partition, partitions))


def usage_log_prefix(partition: int, partitions: int) -> str:
    """The prefix of the usage ledger's keys in this partition (broker.streams.usage), which the terminal event's own
    script extends with the stream's ``key_id`` ('-' for none): ``<prefix><key>`` the Redis Stream of one key's
    billed records, ``<prefix>free:<key>`` of its free ones (no tokens), ``<prefix>day:<key>:<day>`` the hash of
    its records' sums on one UTC day (days since the epoch). Key ids hold no ``:``, so none of these meet."""
    return USAGE_PREFIX.build(tag=tagged(partition, partitions))


def usage_log_key(partition: int, partitions: int, key_id: str) -> str:
    return USAGE_LOG.build(usage=usage_log_prefix(partition, partitions), key=key_id or "-")


def usage_free_key(partition: int, partitions: int, key_id: str) -> str:
    return USAGE_FREE.build(usage=usage_log_prefix(partition, partitions), key=key_id or "-")


def usage_day_key(partition: int, partitions: int, key_id: str, day: int) -> str:
    return USAGE_DAY.build(usage=usage_log_prefix(partition, partitions), key=key_id or "-", day=str(day))


def usage_rollups_since_key(partition: int, partitions: int) -> str:
    """String: the last day (days since the epoch) whose records have no complete day hashes in this partition (the
    day the ledger was upgraded to them; -1 on a new deployment): reports read the records of that day and before,
    and the day hashes after."""
    return USAGE_ROLLUPS_SINCE.build(tag=tagged(partition, partitions))


def usage_index_key(partition: int, partitions: int) -> str:
    """Sorted set of the key ids ('-' for none) with usage records in this partition, scored by their last record
    (Unix ms): the keys a report of every key reads."""
    return USAGE_INDEX.build(tag=tagged(partition, partitions))


def aborted_totals_key(partition: int, partitions: int) -> str:
    """Hash of running totals of aborted generations, ``<reason>|<counter>`` fields, for /metrics."""
    return ABORTED_TOTALS.build(tag=tagged(partition, partitions))


def outbox_key(partition: int, partitions: int) -> str:
    """Hash of the webhook events of this partition not delivered yet (broker.streams.outbox). The outbox's scripts
    name each destination's sorted set of its events from it: ``<outbox>:d:<destination digest>``."""
    return OUTBOX.build(tag=tagged(partition, partitions))


def outbox_dests_key(partition: int, partitions: int) -> str:
    """Sorted set of the destinations with pending events, by when the first may next be taken (Unix ms)."""
    return OUTBOX_DESTS.build(tag=tagged(partition, partitions))


def outbox_holds_key(partition: int, partitions: int) -> str:
    """Hash of the failing destinations: ``<held until, Unix ms> <failures in a row>`` (the circuit breaker)."""
    return OUTBOX_HOLDS.build(tag=tagged(partition, partitions))


def outbox_due_key(partition: int, partitions: int) -> str:
    """Sorted set of event ids by when each is next due (Unix ms): the outbox before destinations were kept apart,
    emptied into them by TAKE."""
    return OUTBOX_DUE.build(tag=tagged(partition, partitions))


def budget_key(partition: int, partitions: int, key_id: str, period: str) -> str:
    """Hash of one API key's budget in one period (``2026-12`` or ``2026-12-03``) and partition: ``reserved`` and
    ``used`` tokens (broker.streams.budget)."""
    return BUDGET.build(tag=tagged(partition, partitions), key=key_id or "-", period=period)


def conversation_digest(key_id: str, name: str) -> str:
    """A conversation's name within its API key, as it reaches key names: a digest (the name is a client's
    string: a UUID, or an AI SDK chat id of up to 256 characters). The key id is part of it, so one tenant's
    conversation id never names another's conversation."""
    return hashlib.sha256(f"{key_id or '-'}\n{name}".encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class ConversationKeys:
    """The keys of one conversation (broker.streams.conversations). They share the hash tag of the
    conversation's own partition (the CRC-32 of its digest), so every conversation script runs in one slot;
    its turns' streams live in their own partitions, in other slots on Redis Cluster, and no script touches
    both (broker.streams.conversations says how a turn stays atomic without that)."""

    digest: str
    partition: int
    partitions: int = 1

    @classmethod
    def of(cls, key_id: str, name: str, partitions: int) -> ConversationKeys:
        digest = conversation_digest(key_id, name)
        return cls(digest, zlib.crc32(digest.encode()) % partitions, partitions)

    @property
    def _tag(self) -> str:
        return tagged(self.partition, self.partitions)

    @property
    def meta(self) -> str:
        """Hash: version, turn count, bytes, the pending turn, expiry. See broker.streams.conversation_scripts."""
        return CONVERSATION_META.build(tag=self._tag, digest=self.digest)

    @property
    def turns(self) -> str:
        """List: the conversation's finished turns, in order, one JSON record each (broker.streams.turns)."""
        return CONVERSATION_TURNS.build(tag=self._tag, digest=self.digest)

    @property
    def named(self) -> dict[str, str]:
        """The KEYS of most conversation scripts, by name (broker.streams.conversation_scripts.CONVERSATION_KEYS)."""
        return {"meta": self.meta, "turns": self.turns}

    def owner(self, tenant: str) -> str:
        """Sorted set of the conversations one tenant (their owner) holds in this partition, each scored by its
        expiry (Unix ms): counted against ``--max-conversations`` in the same step that creates one."""
        return CONVERSATION_OWNER.build(tag=self._tag, tenant=tenant or "-")


def served_models_key() -> str:
    """Sorted set: the name of each model a generator serves, scored by when (Unix ms) one last said so.
    One key for the deployment, outside every partition: only single-key commands touch it."""
    return SERVED_MODELS.build()


def served_workers_key() -> str:
    """Sorted set: each generator serving a model, as ``<model>\n<worker id>``, scored by when (Unix ms) it last
    said so; a generator that stops cleanly withdraws. Beside ``served_models_key``, with the same reach."""
    return SERVED_WORKERS.build()


def read_token_secret_key() -> str:
    """String: the random key that signs read tokens when no ``--read-token-secret`` is configured (made once, by
    the first pod that needs it: broker.streams.read_token_secret). One key for the deployment, outside every
    partition."""
    return READ_TOKEN_SECRET.build()


def model_tag(model: str) -> str:
    """A served model's name as it reaches key names: itself when it is a plain name (the one KEDA's triggers and
    an operator's ``redis-cli`` see), else a digest. A name is an operator's (``--model-name``), never a client's
    (a create names a model the consumer resolved against the served ones), but braces would move the hash tag."""
    if model and len(model) <= 96 and all(c.isalnum() or c in "._-" for c in model):
        return model
    return "h-" + hashlib.sha256(model.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class TokenCountKeys:
    """The token counts of one model (broker.streams.token_counts): outside every partition, only single-key
    commands touch them."""

    model: str

    @property
    def prefix(self) -> str:
        return TOKEN_COUNTS.build(model=model_tag(self.model))

    @property
    def questions(self) -> str:
        """List: the ids of the questions waiting for a generator of the model (bounded, expiring when idle)."""
        return TOKEN_COUNT_QUESTIONS.build(counts=self.prefix)

    @property
    def counters(self) -> str:
        """String with a TTL: present while a generator that counts this model's tokens is alive."""
        return TOKEN_COUNT_LIVE.build(counts=self.prefix)


def token_count_question_key(question_id: str) -> str:
    """String with a TTL: a question's request (its canonical JSON), for as long as its asker waits."""
    return TOKEN_COUNT_QUESTION.build(question=question_id)


def token_count_answer_key(question_id: str) -> str:
    """List with a TTL: the answer to a question, which its asker waits on (BLPOP)."""
    return TOKEN_COUNT_ANSWER.build(question=question_id)


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """The job queue of one model in one partition (broker.streams.queue_scripts says how a job moves through
    it). Every key starts with ``prefix``, which the scripts also store in a stream's meta (``qp``) to reach the
    queue from the stream; the tiers' rings and tenants' lines only scripts name (``QUEUE_RING``, ``QUEUE_WAITING``)."""

    partition: int
    partitions: int
    model: str

    @property
    def prefix(self) -> str:
        return QUEUE_PREFIX.build(tag=tagged(self.partition, self.partitions), model=model_tag(self.model))

    @property
    def stats(self) -> str:
        """Hash: ``waiting`` and ``waiting:<tier>`` (queued jobs), ``busy`` (running ones), ``ema_job_s`` (a moving
        average of job time: ETAs, Retry-After), ``served:<tier>`` (when a claim last took that tier, Unix ms)."""
        return QUEUE_STATS.build(qp=self.prefix)

    @property
    def backlog(self) -> str:
        """Redis Stream, one entry per unfinished job (queued or running; field ``sid``), deleted when the job
        ends: its length is the signal KEDA scales a model's generators on. Nothing reads its entries."""
        return QUEUE_BACKLOG.build(qp=self.prefix)

    @property
    def leases(self) -> str:
        """Sorted set: each running job's stream id, scored by when its lease ends (server Unix ms). A score in
        the past is a job to take over (its worker died or handed it back: score 0)."""
        return QUEUE_LEASES.build(qp=self.prefix)

    @property
    def deferred(self) -> str:
        """Sorted set: queued jobs left for the worker that holds their chat's prefix, scored by when any worker
        may take them (server Unix ms)."""
        return QUEUE_DEFERRED.build(qp=self.prefix)

    @property
    def wake(self) -> str:
        """List of wake-up tokens: each enqueue pushes one, and an idle worker blocks on it (BLPOP), so one new
        job wakes one worker. Trimmed: a token only ends a wait, the claim script decides."""
        return QUEUE_WAKE.build(qp=self.prefix)

    def wake_for(self, worker_id: str) -> str:
        """List of wake-up tokens for one worker: a job was left in its inbox."""
        return QUEUE_WAKE_FOR.build(qp=self.prefix, worker=worker_id)

    def inbox(self, worker_id: str) -> str:
        """List of the stream ids of jobs left for one worker (chat-affine claiming); stale ones are skipped."""
        return QUEUE_INBOX.build(qp=self.prefix, worker=worker_id)

    def receipt(self, worker_id: str) -> str:
        """Hash: one worker's last claim in this queue (its token, stream id and fence), kept for a lease. A claim
        whose reply was lost (a connection cut after the script ran) asked again with its token gets the same stream
        back, instead of claiming another and leaving the first to lapse (an attempt lost, a lease of stall)."""
        return QUEUE_RECEIPT.build(qp=self.prefix, worker=worker_id)
