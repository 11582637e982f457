"""The conversation service: what every view does to a conversation. A turn's create puts the history in front
of the new messages and makes the turn the conversation's one pending turn (broker.streams.conversations says
how that stays atomic); a read settles a pending turn that ended first, so a second device sees every finished
answer. Views translate their protocol's requests into these calls and their answers into its shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.ascii import parse_uuid, parse_uuid_hex
from broker.errors import (
    Conflict,
    ConversationFull,
    Expired,
    InvalidRequest,
    NotFound,
    RetryLater,
    TooManyConversations,
)
from broker.request.generation import GenerationRequest, Message
from broker.request.history import History
from broker.request.on_busy import INTERRUPT, REJECT
from broker.streams.conversations import (
    MAX_WAITING,
    Begin,
    Conversation,
    ConversationStore,
    Limits,
    Settled,
    absent,
)
from broker.streams.keys import tenant_of
from broker.streams.records import TERMINAL_STATUSES, Created, StreamStatus
from broker.streams.turns import Turn, as_messages, output_of, turn_identity, with_history
from consumer.streaming.service import Caller, StreamService

#: OpenAI's spelling of a conversation id: ``conv_`` and the 32 hex digits of its UUID. Both spellings name the
#: same conversation on every route (docs/protocol.md, "Conversations").
OPENAI_PREFIX = "conv_"
_UUID_CHARS = 36


def conversation_name(raw: object, error: Exception | None = None) -> str:
    """A conversation id as a client sent it (a UUID, or ``conv_<hex>``) as the name it is stored under: the
    UUID's canonical text. Anything else raises ``error`` (default: a 400 naming the field)."""
    parsed = (parse_uuid_hex(raw[len(OPENAI_PREFIX):]) if isinstance(raw, str) and raw.startswith(OPENAI_PREFIX)
              else parse_uuid(raw))
    if parsed is not None:
        return str(parsed)
    raise error or InvalidRequest("'conversation' must be a UUID like 123e4567-e89b-12d3-a456-426614174000 "
                                  "(or OpenAI's conv_<32 hex digits>)")


def openai_id(name: str) -> str:
    """The ``conv_`` spelling of a conversation named by a UUID."""
    return OPENAI_PREFIX + uuid.UUID(name).hex


# How many times a create or read goes round (read, settle, reserve) when other requests keep changing the
# conversation under it; each round is a few round trips, and a change needs another request's success.
ROUNDS = 8


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A conversation as a second device reads it: every finished turn, and the pending one (its stream's
    status, or None while its stream is being created)."""

    conversation: Conversation
    pending: StreamStatus | None

    @property
    def pending_id(self) -> uuid.UUID | None:
        p = self.conversation.pending
        return p.stream_id if p is not None else None


@dataclass(frozen=True, slots=True)
class TurnStarted:
    stream_id: uuid.UUID
    created: Created


class ConversationService:
    def __init__(self, service: StreamService, conversations: ConversationStore) -> None:
        self.service = service
        self.conversations = conversations

    def limits(self, caller: Caller) -> Limits:
        s = self.service.settings
        return Limits(s.conversation_ttl_s,
                      self.service.key_limit(caller, "max_conversations") or s.max_conversations,
                      self.service.storage_quota(caller).quota_bytes)

    def owner(self, caller: Caller) -> str:
        """The caller's tenant, which owns the conversations it makes (their count and storage are its)."""
        return tenant_of(caller.key_id, caller.ip)

    # -- reading -------------------------------------------------------------------------------

    async def snapshot(self, caller: Caller, name: str) -> Snapshot | None:
        """The conversation with its pending turn settled (None: the caller has no conversation of this name). Each
        round may fold a turn and start the next that waits: as many rounds as turns may wait, and more."""
        for _ in range(ROUNDS + MAX_WAITING):
            conv = await self.conversations.read(caller.key_id, name)
            if conv is None:
                return None
            if conv.pending is None:
                return Snapshot(conv, None)
            settled, st = await self.conversations.settle(conv)
            if settled in (Settled.RUNNING, Settled.STARTING):
                return Snapshot(conv, st)
        raise Conflict("this conversation keeps changing; read it again")

    async def get(self, caller: Caller, name: str) -> Snapshot:
        snap = await self.snapshot(caller, name)
        if snap is None:
            raise NotFound("no conversation with this id")
        return snap

    async def running_turn(self, snap: Snapshot) -> Turn | None:
        """The pending turn as far as it is known while it runs: its messages, no output (None: no turn runs,
        or its stream is not created yet)."""
        sid = snap.pending_id
        if sid is None or snap.pending is None:
            return None
        return await self._unfinished(sid, snap.pending)

    async def waiting_turns(self, snap: Snapshot) -> list[Turn]:
        """The turns that wait behind the pending one (broker.request.on_busy), in order: their messages, status
        queued."""
        out = []
        for sid in snap.conversation.waiting:
            st = await self.service.store.status(sid)
            turn = None if st is None else await self._unfinished(sid, st)
            if turn is not None:
                out.append(turn)
        return out

    async def _unfinished(self, sid: uuid.UUID, st: StreamStatus) -> Turn | None:
        request = await self.service.request_of(sid)
        if request is None or request.history is None:
            return None
        h = request.history
        return Turn(sid, st.status, tuple(m.stored() for m in (request.messages or ())[h.start:]), h.message_ids,
                    created_at=st.created_at, model=st.model, answer_id=h.answer_id)

    # -- turns ---------------------------------------------------------------------------------

    def _check_size(self, conv: Conversation, new: Sequence[Message]) -> None:
        s = self.service.settings
        if conv.count >= s.conversation_max_turns:
            raise ConversationFull(f"this conversation holds {conv.count} turns, as many as it may "
                                   f"(--conversation-max-turns); start a new conversation")
        added = sum(len(m.content) for m in new)
        if conv.bytes + added > s.conversation_max_bytes:
            raise ConversationFull(f"this conversation's history holds {conv.bytes} bytes; with these messages "
                                   f"it would pass its bound of {s.conversation_max_bytes} "
                                   "(--conversation-max-bytes); start a new conversation")

    def _check_bounds(self, caller: Caller, messages: Sequence[Message], lead: int, what: str, tail: str) -> None:
        """``conversation_full`` when the assembled ``messages`` (history included) pass the caller's request
        limits; the history is what made them too long. ``tail`` ends the message's bounds."""
        limits = self.service.limits_for(caller)
        chars = sum(len(m.content) for m in messages)
        if len(messages) > limits.max_messages + lead or chars > limits.max_prompt_chars:
            raise ConversationFull(
                f"{what} make {len(messages)} messages of {chars} characters, past this server's bounds "
                f"({limits.max_messages} messages, {limits.max_prompt_chars} characters{tail}")

    def assemble(self, caller: Caller, conv: Conversation, request: GenerationRequest, lead: int,
                 message_ids: Sequence[str], answer_id: str | None = None) -> GenerationRequest:
        """The request the engine gets: this request's instructions (``messages[:lead]``), the conversation's
        history, then its new messages. Past the request limits it is ``conversation_full``: the history is
        what made it too long."""
        marked = self.turn_request(conv, request, lead, message_ids, answer_id)
        assembled = with_history(marked, conv.turns, conv.version, conv.count)
        self._check_bounds(caller, assembled.messages or (), lead, "this conversation's history and the new messages",
                           ": --max-messages, --max-prompt-chars); start a new conversation")
        return assembled

    def turn_request(self, conv: Conversation, request: GenerationRequest, lead: int, message_ids: Sequence[str],
                     answer_id: str | None = None) -> GenerationRequest:
        """``request`` marked as the conversation's turn (its instructions, then its new messages: no history in
        front yet). Refused past the conversation's bounds (``conversation_full``)."""
        if request.messages is None:
            raise InvalidRequest("a conversation's turn takes 'messages', not 'prompt'")
        self._check_size(conv, request.messages[lead:])
        return dataclasses.replace(request, history=History(
            lead=lead, start=lead, conversation=conv.name, tenant=conv.key_id, version=conv.version, turn=conv.count,
            message_ids=tuple(message_ids), answer_id=answer_id))

    async def start(self, caller: Caller, name: str, request: GenerationRequest, *, lead: int = 0,
                    stream_id: uuid.UUID | None = None, implicit: bool = True,
                    message_ids: Sequence[str] = (), hook_name: Callable[[uuid.UUID], str] | None = None,
                    on_busy: str = REJECT) -> TurnStarted:
        """Start the conversation's next turn: ``request``'s messages after ``lead`` are the new ones. A
        ``stream_id`` the conversation already has as a turn is a retry of that turn (200, no new generation).
        ``implicit``: a conversation of this name is made if the caller has none (else 404). While another turn
        runs: ``on_busy`` (broker.request.on_busy): ``reject`` raises Conflict, ``enqueue`` and ``interrupt`` put it in
        line (``queue``). Raises Conflict too when the history changed under a race that kept being lost."""
        for _ in range(ROUNDS):
            snap = await self.snapshot(caller, name)
            if snap is None:
                if not implicit:
                    raise NotFound("no conversation with this id")
                conv = absent(caller.key_id, name)
            else:
                conv = snap.conversation
            if stream_id is not None and (done := conv.turn(stream_id)) is not None:
                if list(done.input) != [m.stored() for m in (request.messages or ())[lead:]]:
                    raise Conflict("a stream with this id exists with a different request")
                return TurnStarted(stream_id, Created(False, done.status))
            pending = snap.pending_id if snap is not None else None
            sid = stream_id or uuid.uuid4()
            if pending is not None and on_busy != REJECT:
                started = await self.queue(caller, conv, self.turn_request(conv, request, lead, message_ids), sid,
                                           on_busy, implicit=implicit, hook_name=hook_name)
            elif pending is not None and pending != stream_id:
                raise Conflict(f"a turn of this conversation is running (stream {pending}); wait for its end, cancel "
                               "it, or send with on_busy 'interrupt' or 'enqueue'")
            else:
                started = await self.begin(caller, conv, self.assemble(caller, conv, request, lead, message_ids), sid,
                                           implicit=implicit, hook_name=hook_name, busy=on_busy)
            if started is not None:
                return started
        raise Conflict("this conversation kept changing under this request; retry")

    async def begin(self, caller: Caller, conv: Conversation, request: GenerationRequest, stream_id: uuid.UUID, *,
                    implicit: bool = True, hook_name: Callable[[uuid.UUID], str] | None = None,
                    busy: str = REJECT) -> TurnStarted | None:
        """Reserve the turn on the history ``conv`` holds and create its stream (``request``: assembled). None:
        the conversation changed since it was read (read it again), or (``busy`` other than ``reject``) a turn
        began meanwhile. Raises Conflict when another turn is pending, and whatever the stream's create raises."""
        outcome, other = await self.conversations.begin(conv, stream_id, self.owner(caller), self.limits(caller),
                                                        create=implicit)
        if outcome is Begin.BUSY:
            if busy != REJECT:
                return None  # read again: the turn that runs is there to queue behind
            raise Conflict(f"a turn of this conversation is running (stream {other}); wait for its end, or cancel it")
        if outcome is Begin.FULL:
            limit = self.limits(caller).max_conversations
            raise TooManyConversations(limit)
        if outcome in (Begin.CHANGED, Begin.GONE):
            return None
        started = await self._create(caller, conv, request, stream_id, outcome, hook_name=hook_name)
        # An interrupt may have come while this turn's stream was being created (it found the reservation, not yet
        # the stream, to cancel): the conversation is settled now that the stream exists.
        await self.conversations.advance(conv.key_id, conv.name)
        return started

    async def queue(self, caller: Caller, conv: Conversation, request: GenerationRequest, stream_id: uuid.UUID,
                    mode: str, *, implicit: bool = True, hook_name: Callable[[uuid.UUID], str] | None = None
                    ) -> TurnStarted | None:
        """Put the turn in line behind the one that runs (broker.request.on_busy: ``enqueue``, ``interrupt``) and create
        its stream held (``request``: the turn's own, ``turn_request``; its history goes in front when it comes
        up). ``interrupt`` cancels the running turn. None: nothing runs any more, or the history changed (read
        again). Raises Conflict when MAX_WAITING turns wait already, and whatever the stream's create raises."""
        outcome, pending, ahead = await self.conversations.queue(
            conv, stream_id, self.owner(caller), self.limits(caller), mode=mode, create=implicit)
        if outcome is Begin.BUSY:
            raise Conflict(f"{MAX_WAITING} turns of this conversation wait already behind the running one (stream "
                           f"{pending}); wait for its end")
        if outcome is Begin.FULL:
            raise TooManyConversations(self.limits(caller).max_conversations)
        if outcome not in (Begin.QUEUED, Begin.ALREADY):
            return None
        held: dict[str, object] = {"position": ahead + 1, "eta_s": None}
        if pending is not None:
            held["waiting_for"] = str(pending)  # the turn that runs before this one
        started = await self._create(caller, conv, request, stream_id, outcome, hook_name=hook_name, held=held)
        if mode == INTERRUPT and pending is not None:
            with contextlib.suppress(NotFound, Expired):  # it ended and went meanwhile: nothing to stop
                await self.service.cancel(caller, pending)
        await self.conversations.advance(conv.key_id, conv.name)
        return started

    async def _create(self, caller: Caller, conv: Conversation, request: GenerationRequest, stream_id: uuid.UUID,
                      outcome: Begin, *, hook_name: Callable[[uuid.UUID], str] | None,
                      held: dict[str, object] | None = None) -> TurnStarted:
        """Create the stream of a turn the conversation holds now (reserved or in line: ``outcome``); taken out of
        it again when the create is refused."""
        try:
            created = await self.service.create(caller, request, stream_id, hook_name=hook_name,
                                                identity=turn_identity(request), held=held)
        except Conflict:
            if outcome is not Begin.ALREADY:  # the id is another stream's: this request's place names nothing
                await self.conversations.release(conv.key_id, conv.name, stream_id)
            raise
        except Expired:
            # Either the id was used long ago, or a request that found this reservation stale took it back.
            if await self.conversations.release(conv.key_id, conv.name, stream_id):
                raise
            raise Conflict("another request's turn took this one's place in the conversation; retry") from None
        except RetryLater:
            await self.conversations.release(conv.key_id, conv.name, stream_id)
            raise
        return TurnStarted(stream_id, created)

    async def continue_response(self, caller: Caller, previous: uuid.UUID, request: GenerationRequest,
                                lead: int = 0) -> GenerationRequest:
        """``request`` continuing the response ``previous`` (OpenAI's ``previous_response_id``): that response's
        messages after its own instructions, its answer, then this request's new messages. The previous
        response must have ended (its answer is the history) and be within its retention."""
        st = await self.service.status(caller, previous)  # 404 / 410, the owner checked
        if st.status not in TERMINAL_STATUSES:
            raise Conflict("the previous response has not ended yet; wait for it (its answer is part of the history)")
        prev = await self.service.request_of(previous)
        if prev is None or prev.messages is None or request.messages is None:
            raise InvalidRequest("the previous response cannot be continued (it has no messages)")
        prev_lead = prev.history.lead if prev.history is not None else 0
        output, _, _ = output_of(await self.service.events_so_far(previous))
        history = [*prev.messages[prev_lead:], *([] if output.empty else as_messages([output.message()]))]
        messages = (*request.messages[:lead], *history, *request.messages[lead:])
        self._check_bounds(caller, messages, lead, "the previous responses and these messages", ")")
        return dataclasses.replace(request, messages=messages,
                                   history=History(lead=lead, start=lead + len(history), previous=str(previous)))
