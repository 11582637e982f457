"""OpenTelemetry for every rsb process: configured by the SDK's own variables, off (and free) unless an exporter is.

What turns it on is what turns on any OpenTelemetry SDK: ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``
(``otlp``, ``console``, ``none``), or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, or its ``_TRACES_`` /
``_METRICS_`` twin), which implies ``otlp``. ``OTEL_SDK_DISABLED=true`` turns everything off. The SDK reads the
rest itself: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the default service name is the role's,
``rsb-consumer`` or ``rsb-generator``), the exporter's headers, timeout and compression, ``OTEL_BSP_*``,
``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_TRACES_SAMPLER``. The SDK is the ``rsb[otel]`` extra: asked for and not
installed, ``setup`` raises ``TelemetryMissing``, one line naming what to install.

Off, nothing of OpenTelemetry is imported, and the hot paths pay one ``is None`` test: ``TRACER`` and ``METER``
are None. Exporting is the SDK's batch processor's business, in a thread of its own with a bounded queue: a
collector that is down or slow drops spans there and never stalls a stream.

The trace context crosses processes as a W3C ``traceparent`` string: a create stores its HTTP span's with the
stream (broker.streams.scripts, meta ``tp``), and the generation's spans are that span's children, whichever
worker claims the job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import Meter
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("rsb.telemetry")

#: The tracer and meter of this process once ``setup`` has run with traces (metrics) exported; None otherwise.
TRACER: Tracer | None = None
METER: Meter | None = None
#: Prompts and answers on the GenAI spans (``gen_ai.input.messages`` / ``gen_ai.output.messages``): the
#: conventions' opt-in, OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT (read by ``setup``).
CAPTURE_CONTENT = False

INSTRUMENTATION = "rsb"
INSTALL = "pip install 'rsb[otel]'"
CONTENT_SWITCH = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# The values of the content switch that put content on spans (opentelemetry-util-genai's spelling too).
_CONTENT_ON = frozenset({"true", "1", "span_only", "span_and_event"})
# How long a process's exit waits for its last spans and metrics to leave (a collector that is down must not
# hold a shutdown: the SDK's own default is 30 s).
SHUTDOWN_TIMEOUT_S = 2.0
# The one export protocol the extra brings; grpc needs its own package.
HTTP_PROTOBUF = "http/protobuf"
_GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"


class TelemetryMissing(Exception):
    """Telemetry is asked for and cannot be had (a package missing, an unknown exporter): one line saying why."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """The exporters the environment asks for, per signal (empty: that signal is off)."""

    traces: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    protocol: str = HTTP_PROTOBUF

    @property
    def any(self) -> bool:
        return bool(self.traces or self.metrics)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("true", "1", "yes", "on")


def _exporters(env: Mapping[str, str], signal: str) -> tuple[str, ...]:
    named = env.get(f"OTEL_{signal}_EXPORTER", "").strip().lower()
    if named:
        return tuple(e for e in (p.strip() for p in named.split(",")) if e and e != "none")
    # Unnamed: on only when an endpoint is given (the SDK would default to otlp at localhost: off is rsb's default).
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"):
        return ("otlp",)
    return ()


def wanted(env: Mapping[str, str] | None = None) -> Wanted:
    """What the SDK's variables in ``env`` (the process's environment) ask for."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return Wanted()
    protocol = (env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or HTTP_PROTOBUF).strip().lower()
    return Wanted(_exporters(env, "TRACES"), _exporters(env, "METRICS"), protocol)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing (or blocked in sys.modules)
        return False


def check(env: Mapping[str, str] | None = None) -> Wanted:
    """Raise TelemetryMissing when the environment asks for telemetry this installation cannot send."""
    want = wanted(env)
    if not want.any:
        return want
    if not _installed("opentelemetry.sdk"):
        variable = "OTEL_EXPORTER_OTLP_ENDPOINT" if "otlp" in want.traces + want.metrics else "OTEL_*_EXPORTER"
        raise TelemetryMissing(f"{variable} asks for OpenTelemetry and its SDK is not installed: {INSTALL}")
    for name in want.traces + want.metrics:
        if name not in ("otlp", "console"):
            raise TelemetryMissing(f"unknown OpenTelemetry exporter {name!r}: rsb exports otlp, console or none")
    if "otlp" in want.traces + want.metrics:
        if want.protocol == "grpc":
            if not _installed("opentelemetry.exporter.otlp.proto.grpc"):
                raise TelemetryMissing(f"OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs pip install {_GRPC_PACKAGE}")
        elif want.protocol != HTTP_PROTOBUF:
            raise TelemetryMissing(f"OTEL_EXPORTER_OTLP_PROTOCOL={want.protocol} is not supported: use "
                                   f"{HTTP_PROTOBUF} (or grpc)")
        elif not _installed("opentelemetry.exporter.otlp.proto.http"):
            raise TelemetryMissing(f"OTLP export needs opentelemetry-exporter-otlp-proto-http: {INSTALL}")
    return want


class Telemetry:
    """The providers ``setup`` made; ``shutdown`` sends what is left, within SHUTDOWN_TIMEOUT_S."""

    def __init__(self, closers: Sequence[Any] = ()) -> None:
        self._closers = list(closers)

    def shutdown(self) -> None:
        global TRACER, METER
        TRACER = METER = None
        for closer in self._closers:
            try:
                closer()
            except Exception as e:  # a collector away at exit: what is left is dropped, the exit goes on
                log.warning("telemetry shutdown: %s", type(e).__name__)
        self._closers.clear()


NOTHING = Telemetry()


def setup(role: str, env: Mapping[str, str] | None = None) -> Telemetry:
    """Start what the environment asks for, for process ``role`` (``rsb-consumer``, ``rsb-generator``: the
    service name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one). Raises TelemetryMissing."""
    global TRACER, METER, CAPTURE_CONTENT
    env = os.environ if env is None else env
    want = check(env)
    CAPTURE_CONTENT = (env.get(CONTENT_SWITCH) or "").strip().lower() in _CONTENT_ON
    if not want.any:
        return NOTHING
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: role}))
    closers: list[Any] = []
    if want.traces:
        closers.append(_start_traces(resource, want))
    if want.metrics:
        closers.append(_start_metrics(resource, want))
    log.info("OpenTelemetry on", extra={"traces": ",".join(want.traces) or "none",
                                        "metrics": ",".join(want.metrics) or "none", "protocol": want.protocol,
                                        "capture_content": CAPTURE_CONTENT})
    return Telemetry(closers)


def _start_traces(resource: Any, want: Wanted) -> Any:
    global TRACER
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # rsb bounds its own exit (SHUTDOWN_TIMEOUT_S): the SDK's exit hook would wait 30 s on a collector away.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for name in want.traces:
        exporter = _otlp("trace_exporter", "OTLPSpanExporter", want) if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    TRACER = trace.get_tracer(INSTRUMENTATION)
    return lambda: _bounded(provider.shutdown)


def _start_metrics(resource: Any, want: Wanted) -> Any:
    global METER
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers = [PeriodicExportingMetricReader(
        _otlp("metric_exporter", "OTLPMetricExporter", want) if name == "otlp" else ConsoleMetricExporter())
        for name in want.metrics]
    provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    metrics.set_meter_provider(provider)
    METER = metrics.get_meter(INSTRUMENTATION)
    return lambda: _bounded(provider.shutdown)


def _bounded(shutdown: Callable[[], object]) -> None:
    """Run a provider's ``shutdown`` (its last export) for SHUTDOWN_TIMEOUT_S at most: the SDK's own bound is 30 s
    and its batch processor takes none, and a collector that is down must not hold the process's exit."""
    worker = threading.Thread(target=shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(SHUTDOWN_TIMEOUT_S)


def _otlp(module: str, cls: str, want: Wanted) -> Any:
    """The OTLP exporter of a signal for the protocol asked (it reads its endpoint, headers and timeout itself)."""
    transport = "grpc" if want.protocol == "grpc" else "http"
    mod = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{transport}.{module}")
    return getattr(mod, cls)()


# -- the trace context across processes (W3C traceparent) ----------------------------------------------------


def traceparent(span: Span | None = None) -> str:
    """The W3C ``traceparent`` of ``span`` (None: the current one); '' when tracing is off or no span is."""
    if TRACER is None:
        return ""
    from opentelemetry import trace

    ctx = (span or trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_of(carrier: Mapping[str, str]) -> Context:
    """The context a carrier's ``traceparent`` (and ``tracestate``) continue: a remote parent, or none."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def remote_parent(tp: str) -> Context | None:
    """The context a stored ``traceparent`` continues (None: none stored, or tracing off)."""
    if not tp or TRACER is None:
        return None
    return context_of({"traceparent": tp})


def headers_of(span: Span) -> dict[str, str]:
    """The W3C headers that make a request's receiver continue ``span``'s trace."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, set_span_in_context(span))
    return carrier


def link_to(tp: str, **attributes: Any) -> list[Any]:
    """A span link to the span a stored ``traceparent`` names (none when there is none)."""
    parent = remote_parent(tp)
    if parent is None:
        return []
    from opentelemetry import trace

    ctx = trace.get_current_span(parent).get_span_context()
    return [trace.Link(ctx, attributes)] if ctx.is_valid else []


@contextlib.contextmanager
def current(span: Span) -> Iterator[None]:
    """``span`` is the current span inside the block (this task's context: its log lines and child spans)."""
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        context.detach(token)


def log_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids (hex), for a log line; None when tracing is off or no span is."""
    if TRACER is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def mark_error(span: Span, error_type: str, message: str = "") -> None:
    """Mark ``span`` failed with ``error.type`` (the conventions' low-cardinality class of the error)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message or error_type))
