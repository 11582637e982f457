"""The stream service: what every protocol view does to a stream, in one place. A view (native SSE, the
OpenAI views, ...) translates its protocol's request into a ``GenerationRequest`` and its events into
frames; creating, finding, cancelling and reading streams, with their ownership checks, limits and
metrics, happen here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import cast

from broker import telemetry
from broker.errors import (
    BudgetExceeded,
    Expired,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    OverStorageQuota,
    RetryLater,
    Starting,
    StoreUnavailable,
)
from broker.events import TERMINAL_TYPES, Event, EventType, parse_event_id
from broker.redis.quota import StorageQuota, default_quota_bytes, read_maxmemory
from broker.request.generation import GenerationRequest, RequestLimits
from broker.request.on_busy import REJECT
from broker.request.tiers import resolve_tier
from broker.streams.budget import NO_BUDGET, Budget, Teams
from broker.streams.conversations import ConversationStore
from broker.streams.keys import tenant_of
from broker.streams.records import Created, Quota, StreamStatus
from broker.streams.served_models import ServedModel, ServedModels
from broker.streams.stream_store import StreamStore
from broker.streams.usage import Prices
from consumer.edge.auth import ApiKeys, ensure_owner
from consumer.edge.limits import ConnectionLimiter
from consumer.metrics import Metrics
from consumer.settings import ConsumerSettings
from consumer.streaming.hub import LiveHub
from consumer.streaming.reader import REPLAY_PAGE, read_batches, read_stream
from consumer.streaming.resets import events_until_reset, from_latest, until_reset
from consumer.streaming.snapshots import AnswerSnapshot, Snapshots
from consumer.streaming.spans import batch_size, one, traced

log = logging.getLogger("rsb.consumer")

# How long a lookup of the served models is reused: creates record the model, and what the generators
# serve changes with a deployment, not per request.
MODELS_CACHE_S = 2.0
# Recorded for a request that names no model while no generator has announced one (none is running yet).
# How often the default storage quota re-reads Redis's maxmemory.
MAXMEMORY_REFRESH_S = 60.0


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is asking: the API key id ("" without keys) and the client's address group
    (consumer.edge.limits.address_group)."""

    key_id: str
    ip: str


class Slot:
    """One long-lived connection counted against the per-address and per-key limits. Release it exactly
    once: when the response that holds it ends, or when the handler fails before one took it over."""

    __slots__ = ("_caller", "_limiter", "_released")

    def __init__(self, limiter: ConnectionLimiter, caller: Caller, key_limit: int) -> None:
        limiter.acquire(caller.ip, caller.key_id, key_limit)  # raises TooManyConnections
        self._limiter, self._caller, self._released = limiter, caller, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter.release(self._caller.ip, self._caller.key_id)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:  # the handler failed: no response holds the slot
            self.release()


class StreamService:
    def __init__(self, settings: ConsumerSettings, store: StreamStore, hub: LiveHub, metrics: Metrics,
                 api_keys: ApiKeys, limiter: ConnectionLimiter, *, expect_model: bool = False,
                 prices: Prices | None = None, teams: Teams | None = None) -> None:
        self.settings = settings
        #: ``--prices`` (a create's worst case in money, for budgets in USD) and ``--teams`` (teams' budgets).
        self.prices = prices
        self.teams = teams
        #: Ready (``/readyz``) only once a model is served: this pod's stack starts its own generators
        #: (``rsb up``), so an empty model list means "not up yet", not "no generator runs now".
        self.expect_model = expect_model
        self.store = store
        self.hub = hub
        self.metrics = metrics
        self.api_keys = api_keys
        self.limiter = limiter
        self.models = ServedModels(store.redis)
        self.conversations = ConversationStore(store)
        #: The answers late joiners read (``latest``), kept per pod.
        self.snapshots = Snapshots(store)
        self._served: list[ServedModel] = []
        self._served_at = -MODELS_CACHE_S
        #: The storage quota of a caller without a bound of its own: --storage-quota-bytes, or (not given) a
        #: fraction of Redis's maxmemory, which ``follow_maxmemory`` keeps up to date.
        self.storage_default = (settings.storage_quota_bytes if settings.storage_quota_bytes is not None
                                else default_quota_bytes(0))

    async def announced_models(self, *, fresh: bool = False) -> list[ServedModel]:
        """The models (and aliases) the generators announced recently (broker.streams.served_models), the most recent
        first: looked up at most every MODELS_CACHE_S, unless ``fresh``."""
        now = time.monotonic()
        # An empty list is looked up again each time: the first announcement shows at once (readiness waits for it).
        if fresh or now - self._served_at >= MODELS_CACHE_S or not self._served:
            self._served = await self.models.recent()
            self._served_at = now
        return self._served

    def declared(self) -> list[str]:
        """The models an operator declared (``--models``, then ``--default-model``): known with no generator."""
        return list(dict.fromkeys((*self.settings.models, *filter(None, [self.settings.default_model]))))

    async def served_models(self) -> list[ServedModel]:
        """What this deployment serves: the announced models and aliases, and the declared ones (listed while no
        generator announces them: their creates wait in their queue for one)."""
        served = await self.announced_models()
        named = {m.id for m in served}
        return [*served, *(ServedModel(d, d) for d in self.declared() if d not in named)]

    async def resolve_model(self, requested: str | None) -> str:
        """The name of the served model a create runs on (``resolve_served``)."""
        return (await self.resolve_served(requested)).root

    async def resolve_served(self, requested: str | None) -> ServedModel:
        """The served model a create runs on (with its generators now): the one it names, or the model of the alias
        it names; naming none, ``--default-model`` (resolved the same way), else the only model served or declared.
        A declared model (``--models``, ``--default-model``) is accepted while no generator announces it: its jobs
        wait in its queue for one. Raises ModelNotFound (nothing is stored or queued), InvalidRequest (it names
        none, several are served, and there is no default) or Starting (it names none and nothing is served)."""
        default = self.settings.default_model
        name = requested or default
        if not name:
            roots = list(dict.fromkeys([*(m.root for m in await self.announced_models()), *self.declared()]))
            if len(roots) == 1:
                name = roots[0]
            elif not roots:
                raise Starting("no generator has announced its model yet", retry_after_s=1)
            else:
                raise InvalidRequest(f"name a model: this server serves {', '.join(roots)} and has no "
                                     "--default-model")
        # Looked up once more on a miss: a generator that started since the list was cached.
        for fresh in (False, True):
            served = await self.announced_models(fresh=fresh)
            for m in served:
                if m.id == name:
                    return ServedModel(m.root, m.root, m.workers)
            if fresh or name in self.declared():
                break
        if name in self.declared():
            return ServedModel(name, name, 0)
        raise ModelNotFound(name, [m.id for m in await self.served_models()])

    async def ready(self) -> None:
        """Raise unless this pod can serve: Redis answers and the live hub's pub/sub connections are up and alive
        (else StoreUnavailable: a pod whose pub/sub link died would serve readers no live event until it
        resubscribed), and, when it ``expect_model``, a model is served (Starting), so that ``GET /v1/models`` lists
        one from the first ready answer on. A standalone pod does not wait for generators: it serves reads and queues
        creates without them, and its model list is what they announce (empty while none runs)."""
        await self.store.redis.ping()
        if not self.hub.healthy:
            raise StoreUnavailable("the live hub's pub/sub connection is down or silent: reconnecting")
        if self.expect_model and not await self.announced_models():
            raise Starting("no generator has announced its model yet", retry_after_s=1)

    # -- limits --------------------------------------------------------------------------------

    def key_limit(self, caller: Caller, name: str) -> int:
        """A per-key limit from the API keys file (0: none)."""
        key = self.api_keys.get(caller.key_id)
        return int(key.limits.get(name, 0)) if key is not None else 0

    @contextlib.contextmanager
    def quota_counted(self) -> Iterator[None]:
        """Around a write charged to a caller's storage quota: a refusal is counted
        (``rsb_storage_quota_rejected_total``)."""
        try:
            yield
        except OverStorageQuota:
            self.metrics.storage_quota.inc()
            raise

    def storage_quota(self, caller: Caller) -> StorageQuota:
        """The bytes the caller may hold in Redis (broker.redis.quota), charged to its API key or address group
        like ``quota``; a key's ``limits.storage_quota_bytes`` overrides the pod's default (0 there: no bound)."""
        limits = {}
        if self.api_keys.enabled:
            key = self.api_keys.get(caller.key_id)
            limits = key.limits if key is not None else {}
        bound = int(limits.get("storage_quota_bytes", self.storage_default))
        return StorageQuota(tenant_of(caller.key_id, caller.ip), bound)

    async def read_storage_default(self) -> None:
        """Set ``storage_default`` to its share of Redis's maxmemory, unless --storage-quota-bytes set it. Redis
        away, or INFO refused: what it was stays (the next read tries again)."""
        if self.settings.storage_quota_bytes is not None:
            return
        try:
            bound = default_quota_bytes(await read_maxmemory(self.store.redis))
        except Exception as e:
            log.debug("could not read Redis's maxmemory: %s", type(e).__name__)
            return
        if bound != self.storage_default:
            log.info("storage quota per caller follows Redis's maxmemory", extra={"quota_bytes": bound})
        self.storage_default = bound

    async def follow_maxmemory(self, interval_s: float = MAXMEMORY_REFRESH_S) -> None:
        """``read_storage_default`` every ``interval_s`` (an operator may resize Redis at run time), until cancelled."""
        while self.settings.storage_quota_bytes is None:
            await asyncio.sleep(interval_s)
            await self.read_storage_default()

    def budgets(self, caller: Caller) -> tuple[Budget, Budget]:
        """The caller's budgets (broker.streams.budget): its API key's, and its key's team's (none without keys)."""
        key = self.api_keys.get(caller.key_id)
        if key is None:
            return NO_BUDGET, NO_BUDGET
        team = self.teams.get(key.team) if key.team and self.teams is not None else None
        return key.budget, team or NO_BUDGET

    def quota(self, caller: Caller) -> Quota:
        """What the caller may have queued or running, and how fast it may create: charged to its API key
        (whose ``limits`` override the pod's defaults; 0 there = no limit), or without keys to its address
        group. Anonymous callers behind one address share it (an office behind NAT): the defaults leave
        them room (docs/security.md)."""
        s = self.settings
        limits = {}
        if self.api_keys.enabled:
            key = self.api_keys.get(caller.key_id)
            limits = key.limits if key is not None else {}
        return Quota(tenant_of(caller.key_id, caller.ip), max_active=int(limits.get("max_active", s.max_active)),
                     burst=int(limits.get("create_burst", s.create_burst)),
                     rate_per_s=float(limits.get("create_rate_per_s", s.create_rate_per_s)))

    def drops_unsupported(self, caller: Caller) -> bool:
        """Whether the caller's requests drop the parameters a model cannot honour instead of a 400: its key's
        ``drop_unsupported_params``, else --drop-unsupported-params."""
        key = self.api_keys.get(caller.key_id)
        if key is not None and key.drop_unsupported_params is not None:
            return key.drop_unsupported_params
        return self.settings.drop_unsupported_params

    def on_busy(self, caller: Caller, asked: str | None) -> str:
        """What a conversation's turn does while another runs (broker.request.on_busy): what it asked for, else its
        key's ``on_busy``, else ``reject``."""
        key = self.api_keys.get(caller.key_id)
        return asked or (key.on_busy if key is not None else "") or REJECT

    def limits_for(self, caller: Caller) -> RequestLimits:
        return self.settings.request_limits(self.key_limit(caller, "max_tokens"))

    def connection(self, caller: Caller) -> Slot:
        """Count a long-lived connection (an SSE read, a wait for the end) before any Redis round trip, so a
        flood past the limit is refused at the lowest cost and never leaves a generation behind."""
        return Slot(self.limiter, caller, self.key_limit(caller, "max_sse"))

    # -- create, find, cancel ------------------------------------------------------------------

    def webhook(self, caller: Caller, stream_id: uuid.UUID, hook_name: Callable[[uuid.UUID], str] | None
                ) -> tuple[str, str] | None:
        """Where the end of the caller's stream is POSTed (its key's ``webhook_url``, else --webhook-url), and the id
        its event names (``hook_name`` of the stream id: a Responses create's ``resp_...``; else the stream id)."""
        key = self.api_keys.get(caller.key_id)
        url = (key.webhook_url if key is not None else None) or self.settings.webhook_url
        if not url:
            return None
        return url, hook_name(stream_id) if hook_name is not None else str(stream_id)

    async def create(self, caller: Caller, request: GenerationRequest, stream_id: uuid.UUID, *,
                     hook_name: Callable[[uuid.UUID], str] | None = None, identity: str | None = None,
                     held: dict[str, object] | None = None) -> Created:
        """Create the stream (or recognise a retry of the same request). Raises Conflict, Expired,
        QueueFull, TooManyGenerations, RateLimited or BudgetExceeded. ``hook_name``: see ``webhook``. ``identity``:
        what a retry must match (default: the whole request; a conversation's turn: broker.streams.turns
        .turn_identity). ``held``: a conversation's turn that waits for the one before it (StreamStore.create)."""
        s = self.settings
        key = self.api_keys.get(caller.key_id)
        tier = resolve_tier(request.service_tier, key.service_tier if key else "", key.service_tiers if key else ())
        served = await self.resolve_served(request.model)
        model = served.root
        budget, team_budget = self.budgets(caller)
        price = self.prices.price(model, tier) if self.prices is not None else None
        if price is None and (budget.usd > 0 or team_budget.usd > 0):
            raise InvalidRequest(f"model {model!r} has no price in --prices, and a budget this key falls under is in "
                                 "USD: name a priced model")
        try:
            with self.quota_counted():
                res = await self.store.create(stream_id, request, model=model, workers=served.workers, tier=tier,
                                              max_queue=s.max_queue, max_queue_wait_s=s.max_queue_wait_s,
                                              retention_s=s.retention_s, abandon_after_s=s.abandon_after_s,
                                              key_id=caller.key_id, quota=self.quota(caller),
                                              storage=self.storage_quota(caller), budget=budget,
                                              team_budget=team_budget, price=price,
                                              webhook=self.webhook(caller, stream_id, hook_name),
                                              usage_retention_s=s.usage_retention_days * 86_400,
                                              max_pending_hooks=s.webhook_max_pending,
                                              trace=telemetry.traceparent(), identity=identity, held=held)
        except RetryLater as e:
            self.metrics.creates_rejected.inc()
            if isinstance(e, BudgetExceeded):
                self.metrics.budget_exceeded.inc()
            raise
        extra: dict[str, object] = {"stream_id": str(stream_id), "key_id": caller.key_id, "new_stream": res.created}
        if s.log_content:
            extra["prompt"] = request.prompt if request.prompt is not None else [
                {"role": m.role, "content": m.content} for m in request.messages or ()]
        log.info("create", extra=extra)
        (self.metrics.streams_created if res.created else self.metrics.creates_replayed).inc()
        return res

    async def status(self, caller: Caller, stream_id: uuid.UUID) -> StreamStatus:
        """The stream's status, if it exists and belongs to the caller (else 404, or 410 once expired)."""
        st = await self.store.status(stream_id)
        if st is None:
            if await self.store.expired(stream_id):
                raise Expired("this stream ended and passed its retention period")
            raise NotFound("no stream with this id")
        ensure_owner(st.key_id, caller.key_id)
        return st

    async def cancel(self, caller: Caller, stream_id: uuid.UUID, reason: str = "client") -> str:
        """Request the stop of a stream's generation; its status after the request."""
        await self.status(caller, stream_id)
        status = await self.store.cancel(stream_id, reason)
        if status is None:
            raise NotFound("no stream with this id")
        self.metrics.cancels.inc()
        if status in TERMINAL_TYPES:  # a queued turn the cancel itself ended: no worker will fold it
            await self.conversations.fold(stream_id)
        return status

    async def request_of(self, stream_id: uuid.UUID) -> GenerationRequest | None:
        return await self.store.request_of(stream_id)

    # -- reading -------------------------------------------------------------------------------

    def batches(self, stream_id: uuid.UUID, after_id: str | None, *, watched: bool = True,
                resets: bool = True) -> AsyncIterator[Sequence[Event] | None]:
        """Every event after ``after_id`` by the batch (a replay page, or the live events that arrived
        together), ``None`` when a heartbeat is due, to the terminal event (consumer.streaming.reader). ``resets``:
        pass ``reset`` events on (a view whose protocol can say "drop what came after this id"); else the
        batches end just before one, so that the response ends and its client re-syncs."""
        batches = read_batches(self.store, self.hub, stream_id, after_id, self.settings.heartbeat_s, watched=watched)
        out = batches if resets else until_reset(batches)
        return out if telemetry.TRACER is None else traced(self.store, stream_id, after_id, out, batch_size)

    def latest(self, stream_id: uuid.UUID, after_id: str | None, *, watched: bool = True, snapshot: bool = True
               ) -> AsyncIterator[Sequence[Event] | AnswerSnapshot | None]:
        """A read "from the latest" (consumer.streaming.snapshots): the answer as it stands first (``snapshot``),
        then every event after it by the batch, as ``batches``; where a ``reset`` would come, a new snapshot of
        the stream as it now is instead (a snapshot replaces what its reader had, so such a read never takes
        text back event by event). Without ``snapshot`` it starts after ``after_id`` (a reconnect)."""
        return from_latest(self.snapshots, self.batches, stream_id, after_id, watched=watched, snapshot=snapshot)

    def tail(self, stream_id: uuid.UUID) -> AsyncGenerator[Event | None, None]:
        """The stream from its first event, live ones included: ``None`` for each heartbeat due; it ends
        before a ``reset`` (the views that tail cannot take text back: their response ends, and the client
        re-syncs). Close it (``aclosing``) so its live subscription ends with the reader, not at garbage
        collection."""
        events = events_until_reset(read_stream(self.store, self.hub, stream_id, None, self.settings.heartbeat_s))
        return events if telemetry.TRACER is None else traced(self.store, stream_id, None, events, one)

    async def fold(self, stream_id: uuid.UUID, feed: Callable[[Event], object],
                   timeout_s: float | None = None) -> bool:
        """Feed every event of the stream to ``feed``, live ones included, until the terminal event (True)
        or ``timeout_s`` (False). A ``reset`` takes back the events after the id it names, so ``feed`` gets
        the events only once they are final (at the end)."""
        kept: list[Event] = []
        ended = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                source = read_stream(self.store, self.hub, stream_id, None, self.settings.heartbeat_s)
                if telemetry.TRACER is not None:
                    source = traced(self.store, stream_id, None, source, one)
                async with aclosing(cast(AsyncGenerator[Event | None, None], source)) as events:
                    async for ev in events:
                        if ev is None:
                            continue
                        if ev.type == EventType.RESET:
                            back = parse_event_id(ev.id) or (0, 0)
                            kept = [k for k in kept if (parse_event_id(k.id) or (0, 0)) <= back]
                            continue
                        kept.append(ev)
                        if ev.is_terminal:
                            ended = True
                            break
        for ev in kept:
            feed(ev)
        return ended

    async def page(self, stream_id: uuid.UUID, after_id: str | None, count: int = REPLAY_PAGE) -> Sequence[Event]:
        """Up to ``count`` events after ``after_id`` (None: from the start), without waiting for more."""
        return await self.store.read(stream_id, after_id, count=count)

    async def last_event_id(self, stream_id: uuid.UUID) -> str | None:
        """The id of the stream's latest event so far (None: none yet)."""
        return await self.store.last_event_id(stream_id)

    async def events_so_far(self, stream_id: uuid.UUID) -> list[Event]:
        """Every event appended so far, without waiting for more."""
        out: list[Event] = []
        last = None
        while True:
            page = await self.page(stream_id, last)
            out.extend(page)
            if len(page) < REPLAY_PAGE:
                return out
            last = page[-1].id
