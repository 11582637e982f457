"""The consumer's state, built once in the app's lifespan and typed: every handler reads it with
``state_of(request)``, never through loose ``app.state`` attributes."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from broker.durable.store import DurableStore
from broker.streams.outbox import Outbox
from broker.streams.stream_store import StreamStore
from broker.streams.token_counts import TokenCounts
from broker.streams.usage import Prices
from consumer.edge.auth import ApiKeys
from consumer.edge.limits import ConnectionLimiter, RefusalBudget, address_group
from consumer.metrics import Metrics
from consumer.settings import ConsumerSettings
from consumer.streaming.conversations import ConversationService
from consumer.streaming.hub import LiveHub
from consumer.streaming.service import Caller, StreamService
from consumer.streaming.sse import Drain

STATE_KEY = "rsb"


@dataclass(frozen=True, slots=True)
class State:
    settings: ConsumerSettings
    store: StreamStore
    hub: LiveHub
    metrics: Metrics
    api_keys: ApiKeys
    limiter: ConnectionLimiter
    service: StreamService
    #: Conversations: a turn's history, one running turn each, the history read back (every view's chats).
    conversations: ConversationService
    #: Durable Streams (consumer/views/durable): streams that clients name and write.
    durable: DurableStore
    #: Set on SIGTERM (by consumer.server) or at the end of the lifespan: open responses end at a frame
    #: boundary and tell their client to reconnect elsewhere.
    draining: Drain
    #: ``--prices``: what usage reports price their tokens at (None: no cost_usd).
    prices: Prices | None = None
    #: The webhook events not delivered yet (consumer.streaming.webhooks delivers them).
    outbox: Outbox | None = None
    #: Token counts asked of the generators (POST /v1/messages/count_tokens), this pod's waits bounded.
    token_counts: TokenCounts | None = None
    #: Reports per caller on this pod (--report-burst, --report-rate-per-min): a token bucket per caller, as refused
    #: requests have.
    reports: RefusalBudget | None = None


def state_of(conn: HTTPConnection) -> State:
    state = conn.scope["state"][STATE_KEY]
    assert isinstance(state, State)
    return state


def caller_of(conn: HTTPConnection) -> Caller:
    """The caller's key id (checked by the auth middleware before any /v1 or /api route runs) and address group
    (consumer.edge.limits.address_group of the client address, which uvicorn takes from X-Forwarded-For when
    the peer is a trusted proxy, --forwarded-allow-ips)."""
    return Caller(str(conn.scope.get("rsb.key_id", "")), address_group(conn.client.host) if conn.client else "")
