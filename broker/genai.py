"""The names rsb's telemetry uses from OpenTelemetry's GenAI semantic conventions (and rsb's own beside them), once.

Spans: a generation attempt is ``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat`` for messages,
``text_completion`` for a prompt); a read of a stored answer is ``fetch_response`` (no inference, no usage). Metrics:
the conventions' model-server histograms in seconds, token usage by ``gen_ai.token.type``, and rsb's queue wait. The
Prometheus names of the same histograms (``prometheus_name``) are what an OpenTelemetry collector's Prometheus
exporter makes of them, so one dashboard reads either (deploy/grafana).
"""

from __future__ import annotations

from dataclasses import dataclass

# -- attributes -----------------------------------------------------------------------------------------------
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
SEED = "gen_ai.request.seed"
STREAM = "gen_ai.request.stream"
CONVERSATION = "gen_ai.conversation.id"
OUTPUT_TYPE = "gen_ai.output.type"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"  # opt-in content (broker.telemetry.CAPTURE_CONTENT)
OUTPUT_MESSAGES = "gen_ai.output.messages"
TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"

# -- rsb's own attributes ---------------------------------------------------------------------------------------
ATTEMPT = "rsb.generation.attempt"  # 1, then 2... for a continuation after a crash or a hand-over
CONTINUED_FROM = "rsb.generation.continued_from_tokens"  # tokens the stream held when this attempt began
WORKER = "rsb.worker.id"
TIER = "rsb.service_tier"
CANCEL_REASON = "rsb.cancel.reason"  # with error.type cancelled: client, disconnect, abandoned, shutdown
RESUME_FROM = "rsb.read.last_event_id"  # a read's resume point (absent: from the start)
EVENTS_SERVED = "rsb.read.events"  # events a read served
APPENDS = "rsb.appends"  # appends (Redis round trips) of an attempt's events
APPEND_SECONDS = "rsb.appends.seconds"  # their time in all
APPEND_MAX_SECONDS = "rsb.appends.max_seconds"  # the slowest one

# -- values -----------------------------------------------------------------------------------------------------
CHAT = "chat"
TEXT_COMPLETION = "text_completion"
FETCH_RESPONSE = "fetch_response"
PROVIDER_RSB = "rsb"  # the server answering, as its clients see it (an upstream's client span names the upstream's)
INPUT, OUTPUT = "input", "output"


@dataclass(frozen=True, slots=True)
class Histogram:
    name: str
    unit: str
    description: str
    buckets: tuple[float, ...]


# The conventions' explicit bucket boundaries for each.
TIME_TO_FIRST_TOKEN = Histogram(
    "gen_ai.server.time_to_first_token", "s", "Time from the create to a generation's first token (queue wait and "
    "prefill), for successful responses", (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                           5.0, 7.5, 10.0))
TIME_PER_OUTPUT_TOKEN = Histogram(
    "gen_ai.server.time_per_output_token", "s", "Time per output token after the first, for successful responses",
    (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5))
REQUEST_DURATION = Histogram(
    "gen_ai.server.request.duration", "s", "Time from the create to a generation's last token (its terminal event)",
    (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92))
TOKEN_USAGE = Histogram(
    "gen_ai.client.token.usage", "{token}", "Input and output tokens of each generation, by gen_ai.token.type",
    (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864))
QUEUE_WAIT = Histogram(
    "rsb.generator.queue_wait", "s", "Time from the create to the claim of a job's first attempt, by model and "
    "service tier", (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

_UNIT_SUFFIX = {"s": "_seconds"}


def prometheus_name(h: Histogram) -> str:
    """The name OpenTelemetry's Prometheus translation gives ``h`` (dots to underscores, the unit's suffix; a
    bracketed unit such as ``{token}`` adds none). Its labels are the attributes' names, translated the same way."""
    return h.name.replace(".", "_") + _UNIT_SUFFIX.get(h.unit, "")


def label(attribute: str) -> str:
    """An attribute's Prometheus label name."""
    return attribute.replace(".", "_")
