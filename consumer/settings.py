"""The settings of ``rsb consumer`` (and of the API ``rsb up`` runs), declared once: see broker.settings
for how flags, ``RSB_*`` variables and docs derive from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from broker.request import generation
from broker.request.generation import RequestLimits
from broker.settings import BrokerSettings, LogSettings, Settings, setting
from broker.streams import usage


@dataclass(frozen=True, slots=True)
class ConsumerSettings(Settings):
    title: ClassVar[str] = "API"

    broker: BrokerSettings = field(default_factory=BrokerSettings)
    log: LogSettings = field(default_factory=LogSettings)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    heartbeat_s: float = setting(15.0, "idle seconds before an SSE comment heartbeat")
    max_body_bytes: int = setting(1024 * 1024, "larger request bodies get 413")
    max_queue: int = setting(
        10_000, "queued generations beyond which creates get 429 queue_full: the bound before any job has "
        "finished, when there is no wait estimate yet (0 = no bound)")
    max_queue_wait_s: float = setting(
        300.0, "creates get 429 queue_full while the estimated wait of a new one (waiting jobs x average job "
        "time / running jobs) exceeds this (0 = no bound)")
    max_active: int = setting(
        100, "unfinished (queued or running) generations one caller may have: an API key, or without keys a "
        "client address (an IPv6 /64); more get 429 too_many_generations (0 = no limit; a key's limits.max_active "
        "overrides)")
    create_burst: int = setting(
        100, "creates one caller (as for --max-active) may make at once; past it they refill at "
        "--create-rate-per-s and the rest get 429 rate_limited (0 = no rate limit; a key's limits.create_burst "
        "overrides)")
    create_rate_per_s: float = setting(
        5.0, "sustained creates per second of one caller, once its burst is used (a key's "
        "limits.create_rate_per_s overrides)")
    refusal_burst: int = setting(
        600, "refused requests (4xx) one client address (an IPv6 /64) may cost this pod at once, each 1 unit and 1 "
        "more per 64 KiB of its body; past it they refill at --refusal-rate-per-s and every request of that address "
        "gets 429 too_many_refusals before any work (0 = no limit)")
    refusal_rate_per_s: float = setting(60.0, "units of refusal per second one client address regains")
    abandon_after_s: float = setting(0.0, "cancel generations nobody has read for this long (0 = off)")
    retention_s: int = setting(3600, "how long a finished stream stays readable")
    redis_pool_size: int = setting(
        7, "Redis connections for ordinary commands; live tailing uses one more (pub/sub), whatever the readers")
    max_tokens_limit: int = setting(generation.MAX_TOKENS, "largest max_tokens a request may ask for")
    default_max_tokens: int = setting(generation.DEFAULT_MAX_TOKENS, "max_tokens of a request that sets none")
    shutdown_grace_s: float = setting(5.0, "seconds to drain connections on SIGTERM")
    send_timeout_s: float = setting(
        30.0, "a reader whose connection accepts no event for this long is dropped (it can resume)")
    live_buffer_events: int = setting(
        256, "events one SSE reader's live feed holds while its client reads slower than the stream is written; "
        "past it they are dropped and the reader re-reads them from Redis (with --send-timeout-s and "
        "--max-connections, what bounds the memory unread responses pin in a pod: docs/security.md)")
    default_model: str | None = setting(
        None, "model name recorded for requests that name none (default: the model the generators serve)")
    models: tuple[str, ...] = setting(
        (), "models this deployment serves (comma-separated), declared so that they are known with no generator "
        "running: a create naming one is accepted and queued (its queued event says workers 0) until a generator "
        "of it starts, e.g. one an autoscaler starts from zero on that backlog; GET /v1/models lists them. A name "
        "neither declared nor announced by a live generator is 404 model_not_found")
    api_keys_file: str | None = setting(
        None, "JSON file of API keys; when set, every /v1 and /api route needs 'Authorization: Bearer' (or "
              "'x-api-key', as Anthropic's clients send it)",
        flag="api-keys")
    read_token_secret: str | None = setting(
        None, "secret signing read tokens, the same on every pod (default: a random one made once and kept in "
        "Redis, shared by every pod; docs/security.md says how to rotate either)", secret=True)
    read_token_ttl_s: int = setting(900, "lifetime of the read tokens issued at create")
    read_token_key_refresh_s: float = setting(
        30.0, "without --read-token-secret: how often a pod re-reads the read-token key kept in Redis (a rotation "
        "reaches every pod within this)")
    max_messages: int = setting(generation.MAX_MESSAGES, "most messages one request may carry")
    max_prompt_chars: int = setting(generation.MAX_PROMPT_CHARS, "longest prompt (or messages' content in all)")
    max_streams_per_ip: int = setting(
        1000, "open SSE streams one client address (an IPv6 /64) may hold on this pod; more get 429 "
        "too_many_connections (0 = no limit)")
    max_connections_per_ip: int = setting(
        1200, "TCP connections one peer address (an IPv6 /64) may hold on this pod; more get 429 "
        "too_many_connections, and past twice this a closed socket. Peers in --forwarded-allow-ips are "
        "exempt: a proxy carries many clients, counted by their forwarded address (0 = no limit)")
    max_connections: int = setting(
        0, "TCP connections this pod holds at most; more get 503 overloaded, and past the open-file limit's "
        "last 5 percent a closed socket (0 = 90 percent of the open-file limit, which the consumer raises to "
        "its hard limit at start)")
    header_timeout_s: float = setting(
        10.0, "a connection that has not sent a whole request head this long after it opened (or after the "
        "first byte of its next request) is closed")
    body_timeout_s: float = setting(30.0, "a request body not received whole this long after its head is cut off")
    keep_alive_s: int = setting(5, "an idle keep-alive connection is closed after this long (a proxy's upstream "
                                "keep-alive must be shorter: deploy/nginx.conf)")
    forwarded_allow_ips: tuple[str, ...] = setting(
        ("127.0.0.1", "::1"), "comma-separated proxy addresses or networks (CIDR; '*' for any) whose "
        "X-Forwarded-For names the client: its address for every per-address limit. Only a proxy that "
        "overwrites the header (deploy/nginx.conf) may be trusted. Under rsb up, which has nothing in front "
        "of it, none unless given")
    allowed_hosts: tuple[str, ...] = setting(
        (), "without API keys, the Host names requests may carry besides the loopback ones (localhost, 127.0.0.1, "
        "[::1]) and --host; others get 421 host_not_allowed, so a web page cannot reach an open API by DNS "
        "rebinding (comma-separated; '*' allows any; /healthz and /readyz answer any Host)")
    scrape_port: int = setting(
        0, "also serve /metrics, without any key, on this port of its own (open it to the monitoring network only; "
        "0 = off)")
    scrape_host: str = setting("127.0.0.1", "address of the --scrape-port endpoint")
    metrics_token: str | None = setting(
        None, "with API keys, /metrics needs 'Authorization: Bearer' with any valid API key or this token (for "
        "Prometheus: docs/security.md)", secret=True)
    cors_origins: tuple[str, ...] = setting(
        (), "comma-separated origins allowed by CORS (default: none; '*' for any)")
    log_content: bool = setting(False, "log prompts at create (off by default: users' data)")
    drop_unsupported_params: bool = setting(
        False, "drop a parameter the model cannot honour (OpenAI's reasoning_effort, verbosity, reasoning, "
        "text.verbosity, prompt_cache_retention, ...) instead of answering 400; the response names what it dropped "
        "in X-Rsb-Dropped-Params (a key's drop_unsupported_params in the keys file overrides)")
    # Conversations (broker/streams/conversations.py, docs/protocol.md "Conversations").
    conversation_ttl_s: int = setting(
        30 * 86_400, "a conversation is kept this long after its last use (every read and turn restarts it)")
    conversation_max_turns: int = setting(
        500, "turns one conversation may hold; a create past it gets 409 conversation_full")
    conversation_max_bytes: int = setting(
        1024 * 1024, "bytes one conversation's turns may hold (a turn's output may go past it; the next create "
        "gets 409 conversation_full)")
    max_conversations: int = setting(
        1000, "conversations one caller (as for --max-active) may hold; more get 429 too_many_conversations (0 = "
        "no bound; a key's limits.max_conversations overrides)")
    storage_quota_bytes: int | None = setting(
        None, "bytes one caller (as for --max-active) may hold in Redis: its Durable Streams' data "
        "(forks at their full size) and its streams' request bodies while they are kept; writes past it get 429 "
        "storage_quota (default: an eighth of Redis's maxmemory, re-read every minute, at most 256 MiB; 256 MiB "
        "without maxmemory; 0 = no bound; a key's limits.storage_quota_bytes overrides)")
    # The usage ledger (broker/streams/usage.py, docs/protocol.md "Usage").
    usage_retention_days: int = setting(usage.RETENTION_DAYS, usage.RETENTION_HELP)
    report_burst: int = setting(
        10, "usage and aborted reports one caller (an API key, or without keys an address) may ask for at once on "
        "this pod; past it they refill at --report-rate-per-min and the rest get 429 rate_limited (0 = no limit)")
    report_rate_per_min: float = setting(6.0, "reports per minute one caller may ask for once its burst is used")
    prices_file: str | None = setting(
        None, "JSON file of prices per model ({\"<model>\": {\"input_per_mtok\", \"cached_input_per_mtok\", "
        "\"output_per_mtok\", \"tiers\"?: {\"priority\": {...the same fields}}}}, USD per million tokens): usage "
        "reports then carry cost_usd, and keys may have a usd_budget", flag="prices")
    teams_file: str | None = setting(
        None, "JSON file of teams' budgets ({\"<name>\": {\"token_budget\"?, \"usd_budget\"?, \"budget_period\": "
        "\"day\" | \"month\"}}): a key's \"team\" in the keys file falls under its team's budget besides its own",
        flag="teams")
    # Webhooks (consumer/streaming/webhooks.py, docs/protocol.md "Webhooks").
    webhook_url: str | None = setting(
        None, "POST a signed event (Standard Webhooks; OpenAI's response.completed, .cancelled, .failed, .incomplete) "
        "here when a generation ends (a key's webhook_url in the keys file wins); needs --webhook-secret, unless "
        "every key has its own webhook_secret")
    webhook_secret: str | None = setting(
        None, "the key webhook events are signed with (a key's webhook_secret in the keys file signs its own): whsec_ "
        "and base64, as OpenAI's and Standard Webhooks' verifiers take it", secret=True)
    webhook_allow_private: bool = setting(
        False, "allow webhook URLs that resolve to private or loopback addresses (refused by default: SSRF)")
    webhook_max_pending: int = setting(
        1000, "webhook events one caller (as for --max-active) may have waiting for its receiver; while it has this "
        "many, its creates that would add one get 429 webhook_backlog (0 = no bound). Each pending event also counts "
        "in the caller's storage quota")
    # Durable Streams at /v1/stream/ (consumer/views/durable, docs/protocol.md).
    ds_long_poll_timeout_s: float = setting(
        20.0, "Durable Streams: how long a long-poll waits for data before its 204 (keep it under every proxy's "
        "read timeout)")
    ds_sse_max_s: float = setting(
        60.0, "Durable Streams: an SSE response ends after this long; clients reconnect from their last offset")
    ds_max_body_bytes: int = setting(
        1024 * 1024, "Durable Streams: larger PUT/POST bodies get 413 (deploy/nginx.conf allows 2 MiB)")
    ds_max_stream_bytes: int = setting(
        64 * 1024 * 1024, "Durable Streams: most bytes one stream may hold (each message also counts 64 bytes); "
        "appends past it get 413 (0 = no bound)")
    ds_max_streams: int = setting(
        10000, "Durable Streams one API key may hold, forks included (a key's max_ds_streams limit overrides; "
        "0 = no bound); more get 429")
    ds_read_max_bytes: int = setting(
        1024 * 1024, "Durable Streams: bytes a read response or an SSE data event carries at most (one message "
        "at least)")

    def request_limits(self, key_max_tokens: int = 0) -> RequestLimits:
        """What one create may ask for; ``key_max_tokens`` narrows max_tokens for an API key (0: no limit)."""
        max_tokens = min(self.max_tokens_limit, key_max_tokens) if key_max_tokens else self.max_tokens_limit
        return RequestLimits(max_tokens=max_tokens, default_max_tokens=min(self.default_max_tokens, max_tokens),
                             max_messages=self.max_messages, max_prompt_chars=self.max_prompt_chars)
