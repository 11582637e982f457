"""Conversations in Redis: a conversation holds its finished turns, and at most one pending turn.

A conversation is named by a client's string within its API key (a UUID for the native and OpenAI views, a chat
id for the AI SDK's): broker.streams.keys.ConversationKeys. It is a hash (version, turn count, size, the pending
turn, expiry) and a list of finished turns (broker.streams.turns), in its own partition's slot. Each turn is one
rsb stream, in the stream's own partition: on Redis Cluster the two are in different slots, and no script
touches both. A turn stays atomic anyway:

1. **Reserve.** BEGIN, in the conversation's slot, makes the turn's stream id the conversation's ``pending``
   turn, if no other turn is pending and the history is still the one the request built its prompt from
   (version and turn count: compare-and-set). Two devices sending at once: one reserves, the other gets a
   conflict (409).
2. **Create.** The stream is created under that id (the stream's CREATE, in its slot, idempotent per id) with
   the history in front of the new messages: the engine sees full messages, as for any other request.
3. **Fold.** When the stream has ended, its output is folded in: FOLD appends the turn's record (built from
   the stream's request and events) and clears ``pending`` in one step, only if that stream is still the
   pending one: exactly once, however many fold it. The worker that finishes a stream folds it at once (a
   crashed worker's stream is continued and finished by another, whose fold holds the continued answer);
   every read and create of the conversation folds a pending turn it finds ended too, so a worker killed
   between its finish and its fold loses nothing.

**Sending again while a turn runs** (broker.request.on_busy). ``reject`` is BEGIN's conflict. ``enqueue`` and
``interrupt`` put the new turn in line behind the pending one: QUEUE, in the conversation's slot, adds its stream id to
the conversation's ``waiting`` turns (and, for ``interrupt``, marks it ``cut``); then its stream is created *held*
(CREATE with ``held``: admitted, counted and readable, ``queued``, but in no job line). FOLD, which folds the
pending turn, makes the first waiting turn the pending one in the same step; whoever folded it (the worker, or a
pod settling the conversation) then starts it: UNHOLD, in the stream's slot, gives it the request the history now
makes (every turn before it, the interrupted one's partial answer included) and puts its job in line, once however
many start it. ``interrupt`` cancels the pending turn (its creator at once; anyone who settles the conversation
while the mark stands, too) and every turn waiting before the mark as it comes up, so the interrupting turn runs
next. Every step is one script in one slot and idempotent, so a pod dying between two leaves nothing that the
next settle does not finish; two pods that queue at once get two places in line, in the order Redis ran them.

A process dying between 1 and 2 leaves a reservation with no stream. A request that finds one older than
``PENDING_GRACE_S`` takes the id back: TAKE, in the stream's slot, tombstones the id if no stream has it
(the late creator's CREATE then fails, and it answers a conflict), then RELEASE clears the reservation. A
stream created in time is never taken: it is the turn.

**Retention.** A turn's stream lives ``--retention-s`` after it ends (an hour by default); the conversation
``--conversation-ttl-s`` after its last use (sliding: every read, turn and fold restarts it). The fold must
happen within the stream's retention; the worker's fold does at once, and a read or create does when it
comes. A pending turn whose stream expired unfolded (its worker died right after finishing, and nobody
touched the conversation for the whole retention) is dropped: its reservation is released and the
conversation goes on without it.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from broker.errors import OverStorageQuota, TooManyConversations
from broker.events import Event
from broker.redis.connection import register_script, reply_text
from broker.redis.keyspace import partition_share
from broker.redis.quota import StorageQuota, storage_key
from broker.request.generation import GenerationRequest
from broker.streams import conversation_scripts as scripts
from broker.streams.keys import ConversationKeys
from broker.streams.records import TERMINAL_STATUSES, StreamStatus
from broker.streams.stream_store import StreamStore
from broker.streams.turns import Turn, finished_turn, with_history

#: A reservation younger than this is a create in flight (its stream comes a round trip later); an older one
#: whose stream does not exist is taken back. Generous: a create waits up to 5 s for a replica at
#: ``--durability replicated``.
PENDING_GRACE_S = 10.0
#: How long a taken-back id stays refused (a create under it answers 410, or a conflict for a turn): far longer
#: than any create in flight could still be.
PENDING_TOMBSTONE_S = 86_400
# Events read per page when a stream is folded.
_FOLD_PAGE = 1024
#: Turns that may wait behind a conversation's pending one (more: 409 conflict).
MAX_WAITING = 16
#: The cancel reason of a turn an interrupt stops (the client asked for it: it sent again).
CANCEL_REASON = "client"


@dataclass(frozen=True, slots=True)
class Pending:
    """The conversation's pending turn: reserved ``age_ms`` ago (the server's clock)."""

    stream_id: uuid.UUID
    age_ms: int

    @property
    def fresh(self) -> bool:
        return self.age_ms < PENDING_GRACE_S * 1000


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation as read in one step: its finished ``turns`` (empty when read without them) are the
    ``count`` that ``version`` names."""

    key_id: str
    name: str
    created_at: float
    version: int
    count: int
    bytes: int
    pending: Pending | None
    metadata: dict[str, Any]
    turns: tuple[Turn, ...] = ()
    #: The turns waiting behind the pending one, in order, and the one of them that interrupts (broker.request.on_busy).
    waiting: tuple[uuid.UUID, ...] = ()
    cut: uuid.UUID | None = None

    def turn(self, stream_id: uuid.UUID) -> Turn | None:
        return next((t for t in self.turns if t.id == stream_id), None)


def absent(key_id: str, name: str) -> Conversation:
    """A conversation nobody has made yet, as a native create sees it (BEGIN makes it)."""
    return Conversation(key_id, name, 0.0, 0, 0, 0, None, {})


class Settled(enum.Enum):
    """What became of a conversation's pending turn (ConversationStore.settle)."""

    RUNNING = "running"  # its stream is queued or running: the turn goes on
    STARTING = "starting"  # reserved moments ago, its stream about to be created
    FOLDED = "folded"  # it ended, and is in the history now
    DROPPED = "dropped"  # it named no turn (never created, expired unfolded, another's stream): released
    CHANGED = "changed"  # its stream appeared meanwhile: read the conversation again


class Begin(enum.Enum):
    """What BEGIN (and CREATE, BRANCH, APPEND) answered: its reply's tag."""

    RESERVED = "reserved"  # this request reserved the turn (or made the change)
    ALREADY = "already"  # the turn was already reserved for this stream id (a retry)
    BUSY = "busy"  # another turn is pending
    CHANGED = "changed"  # the history changed since the request read it
    GONE = "gone"  # no such conversation (deleted meanwhile)
    FULL = "full"  # the owner holds as many conversations as it may
    EXISTS = "exists"  # CREATE: a conversation of this name exists
    QUOTA = "quota"  # CREATE, APPEND: the items do not fit the owner's storage quota (raised as OverStorageQuota)
    QUEUED = "queued"  # QUEUE: the turn waits behind the pending one
    IDLE = "idle"  # QUEUE: no turn is pending (start it with BEGIN)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a new conversation gets: its sliding expiry, and how many one owner may hold (0: no bound;
    counted per partition like ``max_active``: each holds ceil(limit / P))."""

    ttl_s: int
    max_conversations: int = 0
    #: The owner's storage quota in bytes (broker.redis.quota; 0: no bound): a conversation's history counts in
    #: it; items added to it past it are refused (a turn's output folds in regardless: the turn has ended).
    storage_quota_bytes: int = 0


class ConversationStore:
    """Every Redis step of conversations. Works unchanged on Redis Cluster: each call touches one slot."""

    def __init__(self, store: StreamStore) -> None:
        self.store = store
        self.redis = store.redis
        self.partitions = store.partitions
        r = self.redis
        self._read = register_script(r, scripts.READ.text)
        self._create = register_script(r, scripts.CREATE.text)
        self._begin = register_script(r, scripts.BEGIN.text)
        self._fold_script = register_script(r, scripts.FOLD.text)
        self._release = register_script(r, scripts.RELEASE.text)
        self._branch = register_script(r, scripts.BRANCH.text)
        self._append = register_script(r, scripts.APPEND.text)
        self._update = register_script(r, scripts.UPDATE.text)
        self._delete = register_script(r, scripts.DELETE.text)
        self._take = register_script(r, scripts.TAKE.text)
        self._queue = register_script(r, scripts.QUEUE.text)

    def keys(self, key_id: str, name: str) -> ConversationKeys:
        return ConversationKeys.of(key_id, name, self.partitions)

    def _share(self, limits: Limits) -> int:
        return partition_share(limits.max_conversations, self.partitions)

    def _storage(self, k: ConversationKeys, owner: str) -> str:
        return storage_key(k.partition, k.partitions, owner)

    async def read(self, key_id: str, name: str, *, with_turns: bool = True) -> Conversation | None:
        k = self.keys(key_id, name)
        raw = await self._read(keys=scripts.READ.keys(k.named), args=scripts.READ.args(
            {"digest": k.digest, "with_turns": int(with_turns)}))
        if not raw:
            return None
        created_at, version, count, size, pending, age, metadata, waiting, cut = (reply_text(v) for v in raw[:9])
        return Conversation(key_id, name, float(created_at), int(version), int(count), int(size),
                            Pending(uuid.UUID(pending), int(age)) if pending else None, orjson.loads(metadata),
                            tuple(Turn.from_json(t) for t in raw[9:]),
                            tuple(uuid.UUID(w) for w in waiting.split(",") if w), uuid.UUID(cut) if cut else None)

    async def create(self, key_id: str, name: str, owner: str, limits: Limits, *, metadata: dict[str, Any],
                     turns: Sequence[Turn] = ()) -> bool:
        """Make a conversation with these first turns (items), created at the server's time. False: one of this name
        exists. Raises TooManyConversations."""
        k = self.keys(key_id, name)
        script = scripts.CREATE
        res = await self._create(
            keys=script.keys({**k.named, "owner": k.owner(owner), "storage": self._storage(k, owner)}),
            args=script.args({"digest": k.digest, "ttl_s": limits.ttl_s, "max_conversations": self._share(limits),
                              "metadata": orjson.dumps(metadata),
                              "storage_share": StorageQuota(owner, limits.storage_quota_bytes).share(self.partitions)},
                             *(t.to_json() for t in turns)))
        outcome = Begin(reply_text(res[0]))
        if outcome is Begin.FULL:
            raise TooManyConversations(limits.max_conversations)
        if outcome is Begin.QUOTA:
            raise OverStorageQuota(limits.storage_quota_bytes, self.partitions, StorageQuota(
                owner, limits.storage_quota_bytes).share(self.partitions))
        return outcome is Begin.RESERVED

    async def begin(self, conv: Conversation, stream_id: uuid.UUID, owner: str, limits: Limits, *,
                    create: bool) -> tuple[Begin, uuid.UUID | None]:
        """Reserve the conversation's next turn for ``stream_id`` on the history ``conv`` holds (``create``:
        make the conversation if ``conv`` is ``absent``). The pending stream id comes back with BUSY."""
        k = self.keys(conv.key_id, conv.name)
        script = scripts.BEGIN
        res = await self._begin(
            keys=script.keys({**k.named, "owner": k.owner(owner), "storage": self._storage(k, owner)}),
            args=script.args({"digest": k.digest, "version": conv.version, "turns": conv.count,
                              "sid": str(stream_id), "ttl_s": limits.ttl_s, "max_conversations": self._share(limits),
                              "create": int(create)}))
        outcome = Begin(reply_text(res[0]))
        return outcome, uuid.UUID(reply_text(res[1])) if outcome is Begin.BUSY else None

    async def queue(self, conv: Conversation, stream_id: uuid.UUID, owner: str, limits: Limits, *, mode: str,
                    create: bool) -> tuple[Begin, uuid.UUID | None, int]:
        """Put ``stream_id`` in line behind the conversation's pending turn (``mode``: broker.request.on_busy's
        ``enqueue`` or ``interrupt``), on the history version ``conv`` holds. Returns QUEUED with the pending turn's id
        and how many turns wait before it; ALREADY (a retry), IDLE (nothing runs: BEGIN), CHANGED, GONE, FULL, or BUSY
        with the pending turn's id when MAX_WAITING turns wait already."""
        k = self.keys(conv.key_id, conv.name)
        script = scripts.QUEUE
        res = await self._queue(
            keys=script.keys({**k.named, "owner": k.owner(owner), "storage": self._storage(k, owner)}),
            args=script.args({"digest": k.digest, "version": conv.version, "sid": str(stream_id), "mode": mode,
                              "max_waiting": MAX_WAITING, "ttl_s": limits.ttl_s,
                              "max_conversations": self._share(limits), "create": int(create)}))
        outcome = Begin(reply_text(res[0]))
        pending = uuid.UUID(reply_text(res[1])) if outcome in (Begin.QUEUED, Begin.BUSY) else None
        return outcome, pending, int(res[2]) if outcome is Begin.QUEUED else 0

    async def release(self, key_id: str, name: str, stream_id: uuid.UUID) -> bool:
        """Take ``stream_id`` out of the conversation if it is still its pending turn (the first waiting one comes
        up) or a waiting one."""
        return bool(await self._release(keys=scripts.RELEASE.keys({"meta": self.keys(key_id, name).meta}),
                                        args=scripts.RELEASE.args({"sid": str(stream_id)})))

    async def take(self, stream_id: uuid.UUID) -> bool:
        """Take a reserved stream id back from a create that never came: True when no stream has it (and none
        can be created under it any more), False when the stream exists after all."""
        k = self.store.keys(stream_id)
        return bool(await self._take(keys=scripts.TAKE.keys({"meta": k.meta, "tombstone": k.tombstone}),
                                     args=scripts.TAKE.args({"ttl_s": PENDING_TOMBSTONE_S})))

    async def branch(self, conv: Conversation, keep: int) -> tuple[Begin, int]:
        """Keep the first ``keep`` turns of ``conv`` (the history it read) and bump the version. Returns
        (RESERVED, the new version), or BUSY / CHANGED / GONE."""
        k = self.keys(conv.key_id, conv.name)
        res = await self._branch(keys=scripts.BRANCH.keys(k.named), args=scripts.BRANCH.args(
            {"digest": k.digest, "version": conv.version, "turns": conv.count, "keep": keep}))
        outcome = Begin(reply_text(res[0]))
        return outcome, int(res[1]) if outcome is Begin.RESERVED else conv.version

    async def append(self, conv: Conversation, turns: Sequence[Turn], storage_quota_bytes: int = 0) -> Begin:
        """Append turns of items to the history ``conv`` holds: RESERVED, or BUSY / CHANGED / GONE. Raises
        OverStorageQuota past its owner's ``storage_quota_bytes``."""
        k = self.keys(conv.key_id, conv.name)
        share = StorageQuota("", storage_quota_bytes).share(self.partitions)
        res = await self._append(keys=scripts.APPEND.keys(k.named), args=scripts.APPEND.args(
            {"digest": k.digest, "version": conv.version, "turns": conv.count, "storage_share": share},
            *(t.to_json() for t in turns)))
        outcome = Begin(reply_text(res[0]))
        if outcome is Begin.QUOTA:
            raise OverStorageQuota(storage_quota_bytes, self.partitions, share)
        return outcome

    async def update(self, key_id: str, name: str, metadata: dict[str, Any]) -> bool:
        k = self.keys(key_id, name)
        return bool(await self._update(keys=scripts.UPDATE.keys(k.named), args=scripts.UPDATE.args(
            {"digest": k.digest, "metadata": orjson.dumps(metadata)})))

    async def delete(self, key_id: str, name: str) -> bool:
        """Delete the conversation. A running turn goes on (and folds into nothing); the turns that waited in it,
        and a pending one not started yet (held), will never start: they are cancelled."""
        k = self.keys(key_id, name)
        raw = await self._delete(keys=scripts.DELETE.keys(k.named), args=scripts.DELETE.args({"digest": k.digest}))
        if not raw:
            return False
        pending, waiting = reply_text(raw[1]), [uuid.UUID(reply_text(sid)) for sid in raw[2:]]
        if pending and (st := await self.store.status(uuid.UUID(pending))) is not None and st.held:
            waiting.insert(0, uuid.UUID(pending))
        for sid in waiting:
            await self.store.cancel(sid, CANCEL_REASON)
        return True

    async def fold(self, stream_id: uuid.UUID) -> bool:
        """Fold a finished stream into the conversation it is a turn of (what a worker does once it finished
        one). False: the stream has not ended, or is no conversation's turn. Idempotent (FOLD is)."""
        st = await self.store.status(stream_id)
        request = await self.store.request_of(stream_id) if st is not None else None
        if st is None or request is None or request.history is None or request.history.conversation is None:
            return False
        folded = await self._fold(stream_id, st, request)
        await self.advance(request.history.tenant, request.history.conversation)
        return folded

    async def advance(self, key_id: str, name: str) -> None:
        """Settle the conversation until its pending turn runs (or none is left): fold turns that ended, start the
        next waiting one (``settle``). What the worker that folded a turn, and a pod that queued one, do."""
        for _ in range(MAX_WAITING + 2):
            conv = await self.read(key_id, name, with_turns=False)
            if conv is None or conv.pending is None:
                return
            settled, _ = await self.settle(conv)
            if settled not in (Settled.FOLDED, Settled.DROPPED, Settled.CHANGED):
                return

    async def _fold(self, stream_id: uuid.UUID, st: StreamStatus, request: GenerationRequest) -> bool:
        history = request.history
        assert history is not None and history.conversation is not None
        if st.status not in TERMINAL_STATUSES:
            return False
        turn = finished_turn(stream_id, request, st.created_at, await self._events(stream_id))
        if turn is None:  # the meta says ended, the terminal event is not readable yet
            return False
        k = self.keys(history.tenant, history.conversation)
        await self._fold_script(keys=scripts.FOLD.keys(k.named), args=scripts.FOLD.args(
            {"digest": k.digest, "sid": str(stream_id), "record": turn.to_json()}))
        return True

    async def settle(self, conv: Conversation) -> tuple[Settled, StreamStatus | None]:
        """Deal with ``conv``'s pending turn: fold it in if it ended, take a reservation whose stream never
        came back, release one that names no turn of this conversation. The stream's status comes back with
        RUNNING. Call it only with a pending turn; read the conversation again after anything but RUNNING
        and STARTING."""
        assert conv.pending is not None
        sid = conv.pending.stream_id
        st = await self.store.status(sid)
        if st is None:
            if not await self.store.expired(sid):
                if conv.pending.fresh:
                    return Settled.STARTING, None  # its create is a round trip away
                if not await self.take(sid):
                    return Settled.CHANGED, None  # created after all: read again
            # Expired before anyone folded it, or taken back: the conversation goes on without it.
            await self.release(conv.key_id, conv.name, sid)
            return Settled.DROPPED, None
        request = await self.store.request_of(sid)
        history = request.history if request is not None else None
        if (request is None or history is None or history.conversation != conv.name
                or history.tenant != conv.key_id or st.key_id != conv.key_id):
            # A reservation whose create found the id taken by another stream, left by a process that died
            # before releasing it: that stream is no turn of this conversation.
            await self.release(conv.key_id, conv.name, sid)
            return Settled.DROPPED, None
        if st.status not in TERMINAL_STATUSES:
            if conv.cut is not None and conv.cut != sid:
                # An interrupt stands behind it: it stops (a queued or held turn ends at once and is folded now;
                # a running one when its worker stops, which folds it).
                if await self.store.cancel(sid, CANCEL_REASON) not in TERMINAL_STATUSES:
                    return Settled.RUNNING, st
                st = await self.store.status(sid)
                if st is None:
                    return Settled.CHANGED, None
            elif st.held:
                await self.unhold(conv, sid, st, request)
                return Settled.RUNNING, st
            else:
                return Settled.RUNNING, st
        await self._fold(sid, st, request)
        return Settled.FOLDED, st

    async def unhold(self, conv: Conversation, stream_id: uuid.UUID, st: StreamStatus,
                     request: GenerationRequest) -> None:
        """Start a held turn that came up (``conv``'s pending one): the history it has now goes in front of its
        messages, and its job into its line (StreamStore.unhold: once). The history is read in the step that finds it
        still pending: while it is, no turn can be added or taken back."""
        now = await self.read(conv.key_id, conv.name)
        if now is None or now.pending is None or now.pending.stream_id != stream_id:
            return  # folded, taken back or deleted meanwhile: whoever did so goes on from there
        await self.store.unhold(stream_id, st.model, with_history(request, now.turns, now.version, now.count))

    async def _events(self, stream_id: uuid.UUID) -> list[Event]:
        out: list[Event] = []
        after: str | None = None
        while True:
            page = await self.store.read(stream_id, after, count=_FOLD_PAGE, visible_only=False)
            out.extend(page)
            if len(page) < _FOLD_PAGE:
                return out
            after = page[-1].id
