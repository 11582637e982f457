"""The exception hierarchy, in one place. Each error carries the JSON ``code`` clients see (a ``RetryLater``, when
to retry; an ``InvalidRequest``, the ``Path`` of the field it is about); what HTTP status a code is answered with is
the HTTP edge's to say, once (consumer.edge.errors.STATUS), and what a protocol calls a field is its view's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

#: Where a value is in a request: its field, then the keys and indexes into it (``("messages", 3, "role")``).
Path = tuple[str | int, ...]
#: In a rename's pattern (InvalidRequest.said), any one key or index, carried into the new path at its place.
ANY = "*"


class RsbError(Exception):
    """Base of every error rsb raises on purpose. ``code`` is the JSON error code clients see."""

    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def spelled(path: Path) -> str:
    """A path as rsb's messages spell it: ``messages[3].role``, ``response_format.json_schema.schema``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def renamed(path: Path, renames: Mapping[Path, Path]) -> Path:
    """``path`` with its longest prefix that ``renames`` names replaced (an ``ANY`` in a pattern matches one key or
    index, which takes the place of the replacement's ``ANY`` in its order)."""
    best: tuple[int, Path] | None = None
    for pattern, replacement in renames.items():
        n = len(pattern)
        if n <= len(path) and (best is None or n > best[0]) \
                and all(p == ANY or p == part for p, part in zip(pattern, path, strict=False)):
            taken = iter(part for p, part in zip(pattern, path, strict=False) if p == ANY)
            best = n, tuple(next(taken) if r == ANY else r for r in replacement)
    return path if best is None else best[1] + path[best[0]:]


class InvalidRequest(RsbError):
    """A request rsb refuses. ``param`` is the path of the field it is about, as data (None: the request as a whole,
    or no one field), which the protocol views translate into their own field names (``said``) instead of reading
    it out of the message.

    Made with ``at(param, rest)``, the message is the field's spelling followed by ``rest`` (``" must be ..."``:
    ``'max_tokens' must be ...``, a lone field quoted; ``": ..."`` or ``".role ..."``: ``messages[3]: ...``), so a
    view spells the field its own way and keeps the rest; made with a message, the message is said as it is."""

    code = "invalid_request"

    def __init__(self, message: str, param: Path | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.rest: str | None = None

    @classmethod
    def at(cls, param: Path, rest: str) -> Self:
        err = cls(_said(param, param, rest), param)
        err.rest = rest
        return err

    def said(self, renames: Mapping[Path, Path]) -> tuple[str, Path | None]:
        """The message and the field, with the field's path renamed (a protocol's names for rsb's fields)."""
        if self.param is None:
            return self.message, None
        param = renamed(self.param, renames)
        return (self.message if self.rest is None else _said(self.param, param, self.rest)), param


def _said(ours: Path, param: Path, rest: str) -> str:
    # A lone field of the request is quoted where a sentence follows ('max_tokens' must be ...); a place within one
    # is not (messages[3].role must be ...), nor is a field a colon follows (response_format: ...).
    name = spelled(param)
    return (f"'{name}'" if len(ours) == 1 and rest.startswith(" ") else name) + rest


class PayloadTooLarge(RsbError):
    code = "payload_too_large"


class NotFound(RsbError):
    code = "not_found"


class ModelNotFound(NotFound):
    """A create named a model no generator serves (none announced it within its listing: broker.streams.served_models),
    nor an alias of one: nothing is stored or queued."""

    code = "model_not_found"

    def __init__(self, model: str, served: list[str]) -> None:
        listed = ", ".join(served) if served else "none yet"
        super().__init__(f"the model {model!r} does not exist or is not served now (served: {listed})")
        self.model = model


class Expired(RsbError):
    code = "expired"


class Unauthorized(RsbError):
    code = "unauthorized"


class HostNotAllowed(RsbError):
    """An open API (no API keys) was reached by a Host name it does not answer (consumer.edge.hosts): DNS
    rebinding, or a name the operator has not listed in --allowed-hosts."""

    code = "host_not_allowed"

    def __init__(self) -> None:
        super().__init__("this server does not answer this Host name; its operator can allow it with "
                         "--allowed-hosts (RSB_ALLOWED_HOSTS)")


class Conflict(RsbError):
    code = "conflict"


class TooManyConversations(RsbError):
    """A caller (an API key, or without keys an address) holds as many conversations as it may
    (``--max-conversations``; counted in Redis, in the step that makes one)."""

    code = "too_many_conversations"

    def __init__(self, limit: int) -> None:
        super().__init__(f"this caller holds as many conversations as it may ({limit}); delete one, or let one "
                         "expire (--conversation-ttl-s)")


class ConversationFull(Conflict):
    """A conversation's history has reached one of its bounds (turns, bytes, or the prompt it makes): the state
    of the conversation refuses the turn, whatever the request (start a new conversation)."""

    code = "conversation_full"


class TooManyStreams(RsbError):
    """An API key holds as many Durable Streams as it may (``--ds-max-streams``, or the key's ``max_ds_streams``)."""

    code = "too_many_streams"


class RetryLater(RsbError):
    """Base for errors that carry a ``Retry-After``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(RetryLater):
    code = "queue_full"


class TooManyConnections(RetryLater):
    """Open streams per client address or per API key at their limit (counted per pod); at the HTTP
    server's level (consumer.edge.guards), connections of one address past their cap."""

    code = "too_many_connections"


class TooManyGenerations(RetryLater):
    """A caller's (an API key's, or without keys an address's) unfinished generations are all in use
    (checked atomically in Redis)."""

    code = "too_many_generations"


class RateLimited(RetryLater):
    """A caller's creates came faster than its rate allows, past its burst (checked atomically in Redis)."""

    code = "rate_limited"


class TooManyRefusals(RetryLater):
    """A client address's requests were refused (4xx) faster than its refusal budget refills (counted per pod,
    consumer.edge.limits.RefusalBudget): its requests wait until the budget is whole again."""

    code = "too_many_refusals"


class Overloaded(RetryLater):
    """The pod holds as many connections as it may (consumer.edge.guards): another pod, or later, may serve."""

    code = "overloaded"


class Starting(RetryLater):
    """Not ready yet: the stack this pod belongs to has no generator serving a model yet (``rsb up``)."""

    code = "starting"


class ShuttingDown(RetryLater):
    """This pod is shutting down (SIGTERM) and could not finish the request within its grace period: another pod,
    or this one restarted, answers the retry."""

    code = "draining"


class Unavailable(RetryLater):
    """Redis is unreachable (or loading): every Redis error reaching the HTTP boundary becomes this."""

    code = "unavailable"


class StorageFull(RetryLater):
    """Redis refuses writes for lack of memory (at ``maxmemory`` under ``noeviction``: ``StoreFull``). Nothing the
    caller did: it frees when data expires or an operator adds memory, so it is answered with a Retry-After, like
    Unavailable, under its own code."""

    code = "storage_full"


class OverStorageQuota(RsbError):
    """A caller (an API key, or without keys an address group) holds as many bytes in Redis as it may
    (``--storage-quota-bytes``; counted in Redis, in the step that writes them)."""

    code = "storage_quota"

    def __init__(self, quota_bytes: int, partitions: int, share_bytes: int) -> None:
        share = f" ({share_bytes} bytes in each of {partitions} partitions)" if partitions > 1 else ""
        super().__init__(f"this caller holds as much data as it may ({quota_bytes} bytes{share}, "
                         "--storage-quota-bytes); delete streams, or let them expire")


class WebhookBacklog(RetryLater):
    """A caller (an API key, or without keys an address group) has as many webhook events pending as it may
    (``--webhook-max-pending``): its receiver is not taking them. Its creates that would add one wait until some are
    delivered (or given up, a day after their end)."""

    code = "webhook_backlog"


class BudgetExceeded(RetryLater):
    """A budget this create falls under (its API key's, its team's: broker.streams.budget) cannot hold its worst case
    for the period: nothing is queued; the budget is whole again at the period's end (the Retry-After). The message
    says whose budget, in what, and how much the create wanted."""

    code = "budget_exceeded"


# -- Redis failing a command: what broker.redis's clients raise, and nothing else -----------------------------------


class StoreError(Exception):
    """A Redis command failed. The clients broker.redis.connection makes raise only this family, never redis-py's
    exceptions: its errors are mapped there, once (``store_error``), as httpx maps httpcore's. Raised as itself for
    an error reply that is neither of the transient kinds below (a script error, WRONGTYPE): a bug, surfaced, never
    retried in silence. Not an RsbError: what a client is told is the HTTP edge's to say (consumer.edge.errors)."""


class StoreTransient(StoreError):
    """Redis cannot do this now, and the same command may succeed later: workers wait and retry, the HTTP edge
    answers with a Retry-After."""


class StoreUnavailable(StoreTransient):
    """Redis is away: unreachable, timing out, loading its data, or a cluster moving a slot or failing over (a
    write landing on a demoted primary gets READONLY). Answered ``503 unavailable`` at the edge."""


class StoreFull(StoreTransient):
    """Redis refuses a write for lack of memory (at ``maxmemory`` under ``noeviction``). The server is up and reads
    work; writes succeed again once memory is freed. Answered ``507 storage_full`` at the edge (StorageFull)."""
