"""redis-py's exceptions mapped to rsb's, here and nowhere else (as httpx maps httpcore's): every client
broker.redis.connection makes raises broker.errors' Store family (``StoreUnavailable``: Redis away;
``StoreFull``: Redis out of memory; a plain ``StoreError``: any other failure, a bug), never redis-py's, so nothing
above broker.redis classifies a Redis error again (tests/test_code_quality.py checks that no module there names
one). Inside broker.redis, code that reads redis-py's own objects (pub/sub, a cluster's slot map) uses the
predicates; what it hands out is mapped too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import redis
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker.errors import StoreError, StoreFull, StoreUnavailable

#: Redis errors that mean "Redis cannot serve this now, try again soon": the server is unreachable, loading,
#: or a cluster is moving slots or failing over (a write landing on a demoted primary gets READONLY; a node
#: client asked for a slot its node no longer serves gets MOVED or ASK). Mapped to StoreUnavailable.
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, BusyLoadingError, ClusterDownError, ClusterError, MasterDownError,
    ReadOnlyError, SlotNotCoveredError, TryAgainError, MovedError, AskError, ConnectionError, OSError)


def transport_closed(exc: BaseException) -> bool:
    """Whether ``exc`` is uvloop refusing to write on a connection the network reset: after an RST on a pooled
    connection, redis-py's next command on it raises ``RuntimeError: unable to perform operation on <TCPTransport
    closed=True ...>; the handler is closed`` (uvloop's transport, where asyncio's raises ConnectionResetError). It
    is the same event as a dropped connection; any other RuntimeError is a bug and stays one."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("unable to perform operation on <TCPTransport")


def is_unavailable(exc: BaseException) -> bool:
    """Whether a redis-py error means "Redis is away" (one of UNAVAILABLE_ERRORS, or a connection uvloop saw reset),
    here where redis-py's errors are seen; everywhere else sees StoreUnavailable."""
    return isinstance(exc, (*UNAVAILABLE_ERRORS, StoreUnavailable)) or transport_closed(exc)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether a redis-py error means "Redis is full": Redis at ``maxmemory`` under ``noeviction`` (or
    ``volatile-*`` with nothing left to evict) refuses every write that could grow memory with ``OOM command not
    allowed when used memory > 'maxmemory'`` (redis-py's OutOfMemoryError, a ResponseError; from a script too,
    whose first write it refuses before anything is written). Everywhere else sees StoreFull."""
    if isinstance(exc, OutOfMemoryError | StoreFull):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith("OOM ")


def store_error(exc: BaseException) -> StoreError:
    """rsb's error for a redis-py one, decided here and nowhere else: full (StoreFull), away (StoreUnavailable),
    or any other failure (StoreError: a bug)."""
    if isinstance(exc, StoreError):
        return exc
    if is_out_of_memory(exc):
        return StoreFull(str(exc))
    if is_unavailable(exc):
        return StoreUnavailable(f"{type(exc).__name__}: {exc}")
    return StoreError(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """Raise rsb's error (``store_error``) for a redis-py one raised inside, chained to it. NOSCRIPT passes as
    it is: it is the signal redis-py's Script (and ``evalsha_many``, broker.redis.batching) load a script on."""
    try:
        yield
    except NoScriptError:
        raise
    except (RedisError, OSError) as e:
        raise store_error(e) from e
    except RuntimeError as e:
        if not transport_closed(e):
            raise
        raise store_error(e) from e


def reply(value: Any) -> Any:
    """A pipeline's reply (``raise_on_error=False``) with an error mapped as a raised one is (``store_error``)."""
    if isinstance(value, Exception) and not isinstance(value, NoScriptError | StoreError):
        return store_error(value)
    return value


# Where redis-py's own code lives: an AttributeError raised in there is a connection closed under a command.
_REDIS_PY_DIR = os.path.dirname(redis.__file__)


def closed_under_the_command(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py's cluster client using a connection that another task has just closed.

    redis-py 8's RedisCluster calls its own ``aclose()`` when a command meets CLUSTERDOWN or an uncovered slot
    (and, unless ``reinitialize_steps=0``, after every fifth MOVED), which disconnects every connection of every
    node, those that other commands are using at that instant included: a command between connecting and writing
    then finds its writer gone (``'NoneType' object has no attribute 'writelines'``). It is the same event as a
    dropped connection, so it is reported as one; an AttributeError raised anywhere else is a bug and stays one."""
    if not isinstance(exc, AttributeError) or "NoneType" not in str(exc):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_REDIS_PY_DIR)
