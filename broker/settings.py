"""Settings of each role. The CLI fills them from flags, whose defaults come from ``RSB_*`` variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: the password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def env(name: str, default: str | None = None) -> str | None:
    """The ``RSB_<NAME>`` twin of a flag."""
    return os.environ.get(f"RSB_{name.upper().replace('-', '_')}", default)


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    redis_url: str = DEFAULT_REDIS_URL
    # Part of every key's address: fixed per deployment (see broker.keys).
    partitions: int = 1
    # redis_url names a Redis Cluster (also implied by a redis+cluster:// URL).
    cluster: bool = False


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    broker: BrokerSettings
    host: str = "127.0.0.1"
    port: int = 8000
    heartbeat_s: float = 15.0
    max_body_bytes: int = 1024 * 1024
    max_queue: int = 0  # 0 = unbounded
    abandon_after_s: float = 0.0
    retention_s: int = 3600
    # Redis connections for ordinary commands; live tailing uses one more (pub/sub), whatever the readers.
    redis_pool_size: int = 7
    max_tokens_limit: int = 32768
    default_max_tokens: int = 256
    shutdown_grace_s: float = 5.0
    # A reader whose socket takes this long to accept one event is dropped (it can resume).
    send_timeout_s: float = 30.0
    # The model name recorded for streams created without one.
    default_model: str = "default"
    # JSON file of API keys (consumer.auth); None: no authentication.
    api_keys_file: str | None = None
    # Secret that signs read tokens (default: derived from the keys file, the same on every pod).
    read_token_secret: str | None = None
    read_token_ttl_s: int = 900
    max_messages: int = 1024
    max_prompt_chars: int = 200_000
    # Open SSE streams one client address may hold on this pod (0: no limit).
    max_streams_per_ip: int = 0
    # Origins allowed to call the API from a browser on another origin (CORS); empty: none.
    cors_origins: tuple[str, ...] = ()
    # Log request content (prompts). Off by default: prompts are the users' data.
    log_content: bool = False


@dataclass(frozen=True, slots=True)
class GeneratorSettings:
    broker: BrokerSettings
    model_path: str | None = None
    upstream_url: str | None = None
    worker_id: str = ""
    lease_s: float = 10.0
    max_attempts: int = 3
    max_generation_s: float = 0.0  # 0 = no deadline
    n_threads: int | None = None
    n_ctx: int = 4096
    retention_s: int = 3600
    shutdown_grace_s: float = 10.0
    # Tokens the inference thread may run ahead of Redis before it waits (the bounded hand-off queue).
    handoff_tokens: int = 256
    # Generations run at once by one worker. In-process llama.cpp has one context: 1. Upstream servers
    # batch requests, so a worker driving one can run several.
    concurrency: int = 1
    # Prometheus /metrics of this worker (0: off).
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # cancel_on_disconnect: how long a stream may have no reader before it is cancelled (reconnects
    # within this grace keep it going). Consumer pods refresh a stream's "seen" every TOUCH_INTERVAL_S.
    disconnect_grace_s: float = 5.0
    # --upstream: the protocol ("openai" or "ollama"; None: from the URL), the model name sent upstream
    # (None: the first one the server lists), a bearer key, and the longest silence between two chunks.
    upstream_api: str | None = None
    upstream_model: str | None = None
    upstream_api_key: str | None = None
    upstream_timeout_s: float = 600.0
