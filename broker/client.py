"""Redis connections. One factory, so every role gets the same timeouts, retries and keepalive."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Ordinary commands: short, so a dead server is noticed in seconds, not minutes.
COMMAND_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0


def _retry(retries: int) -> Retry:
    # Retrying a script whose reply was lost may run it twice: every script is written to be safe
    # under that (CREATE/CANCEL are idempotent, APPEND carries a sequence number, FINISH a status check).
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries,
                 supported_errors=(RedisConnectionError, RedisTimeoutError))


def connect(url: str, *, max_connections: int = 8, retries: int = 3) -> Redis:
    """A client for non-blocking commands. The pool blocks (not fails) when all connections are busy,
    so however many requests a process serves, it never holds more than ``max_connections``."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=COMMAND_TIMEOUT_S,
        socket_timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=30,
    )
    return Redis(connection_pool=pool, retry=_retry(retries))


def connect_blocking(url: str) -> Redis:
    """A client for blocking reads (XREADGROUP BLOCK, pub/sub). redis-py does not extend the socket
    timeout for BLOCK, so these connections have none; TCP keepalive detects a dead server instead."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=2,
        timeout=COMMAND_TIMEOUT_S,
        socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
    )
    return Redis(connection_pool=pool, retry=_retry(0))
