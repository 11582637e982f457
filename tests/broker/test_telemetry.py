"""OpenTelemetry, for real: rsb's processes (``rsb up``, and a separate consumer and generator) export to a real
OTLP/HTTP receiver (tests/otlp_receiver.py, decoding the protobuf with opentelemetry-proto), configured only by the
SDK's own variables. One trace per generation: the client's traceparent, the create's span, the generation's spans
in whichever generator claims it (a continuation after a SIGKILL is attempt 2 of the same trace), the upstream's
request; a resume is a ``fetch_response`` span linked to it. Disabled, nothing is sent; a collector that is down
costs the streams nothing. And the switches themselves (broker.telemetry.wanted / check), without processes."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from helpers import SSE, create, eventually, read_sse
from otlp_receiver import Blackhole, OtlpReceiver, Span
from servers import Stack

from bench.procs import Proc
from broker import genai, telemetry
from broker.redis.server import RedisServer, free_port

SERVER, CLIENT = 2, 3  # OTLP span kinds
ERROR = 2  # OTLP status code


def traceparent() -> tuple[str, str, str]:
    """A client's traceparent: (header, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def exporting_to(url: str, **more: str) -> dict[str, str]:
    """The SDK's variables, as an operator sets them: an endpoint, and short export intervals for a test. The
    export's timeout is 30 s, not the SDK's 10: the receiver is a thread of the test's own process, slow to answer on
    a busy machine, and an export not answered within it is dropped (the SDK's retries share that one deadline)."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_EXPORTER_OTLP_TIMEOUT": "30",
            **more}


class TracedStack(Stack):
    """A Stack whose processes run with ``env`` added to this one's."""

    def __init__(self, redis_url: str, model: Path, tmp: Path, env: dict[str, str]) -> None:
        super().__init__(redis_url, model, tmp)
        self.env = env

    def _run(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        return super()._run(name, args, {**self.env, **(env or {})})

    def export_failures(self) -> list[str]:
        """What the processes' exporters logged about exports they gave up (a span missing at the receiver)."""
        return [line for p in self.procs for line in p.output().splitlines() if "export" in line.lower()]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced(receiver: OtlpReceiver, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[TracedStack]:
    """A consumer and a generator, separate processes as deployed, exporting to ``receiver``."""
    server = RedisServer().start()
    s = TracedStack(server.url, demo_model, tmp_path_factory.mktemp("traced"), exporting_to(receiver.url))
    try:
        s.generator()
        s.consumer()
        yield s
    finally:
        s.close()
        server.cleanup()


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[(s.service, s.name) for s in spans]}"
    return found[0]


def _generation(s: Span) -> bool:
    return s.attributes.get(genai.OPERATION) in (genai.CHAT, genai.TEXT_COMPLETION) and s.service == "rsb-generator" \
        and s.kind != CLIENT


@pytest.mark.slow
def test_a_create_with_a_traceparent_is_one_trace_across_consumer_and_generator(
        traced: Stack, receiver: OtlpReceiver) -> None:
    header, trace_id, client_span = traceparent()
    with traced.client() as c:
        r = c.post("/v1/streams", headers={"traceparent": header}, json={
            "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 4000,
            "temperature": 0.5})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        read = read_sse(c, f"/v1/streams/{sid}/events")
    done = read.events[-1]
    assert done.event == "done", read.events[-1]
    usage = done.data["usage"]
    model = next(e.data["model"] for e in read.events if e.event == "started")

    # The create's server span continues the client's span; the generation's spans continue the create's.
    create_span = receiver.wait_spans(lambda s: s.trace_id == trace_id and s.name == "POST /v1/streams")[0]
    assert (create_span.service, create_span.kind, create_span.parent_id) == ("rsb-consumer", SERVER, client_span)
    assert create_span.attributes["http.response.status_code"] == 201
    assert create_span.attributes["http.route"] == "/v1/streams"
    gen = receiver.wait_spans(lambda s: s.trace_id == trace_id and _generation(s))[0]
    claimed_model = gen.attributes[genai.REQUEST_MODEL]
    assert gen.name == f"chat {claimed_model}" and gen.parent_id == create_span.span_id
    assert gen.attributes[genai.PROVIDER] == "rsb" and gen.attributes[genai.RESPONSE_MODEL] == model
    assert gen.attributes[genai.RESPONSE_ID] == sid and gen.attributes[genai.MAX_TOKENS] == 4000
    assert gen.attributes[genai.TEMPERATURE] == 0.5 and gen.attributes[genai.ATTEMPT] == 1
    assert gen.attributes[genai.INPUT_TOKENS] == usage["prompt_tokens"]
    assert gen.attributes[genai.OUTPUT_TOKENS] == usage["completion_tokens"] > 1000
    assert gen.attributes[genai.FINISH_REASONS] == [done.data["finish_reason"]]
    assert genai.INPUT_MESSAGES not in gen.attributes and genai.OUTPUT_MESSAGES not in gen.attributes  # not opted in
    assert gen.status != ERROR and genai.ERROR_TYPE not in gen.attributes
    # Queue wait, prefill, decode and the appends, readable however long the answer: a few spans and events.
    spans = receiver.wait_spans(lambda s: s.trace_id == trace_id and s.service == "rsb-generator", 4)
    assert _one(spans, "queue wait").parent_id == create_span.span_id
    prefill, decode = _one(spans, "prefill"), _one(spans, "decode")
    assert prefill.parent_id == decode.parent_id == gen.span_id and prefill.end_ns <= decode.start_ns
    assert gen.start_ns <= prefill.start_ns and decode.end_ns <= gen.end_ns
    assert [e[0] for e in gen.events] == ["gen_ai.first_token", "rsb.first_text_appended",
                                          "rsb.terminal_event_appended"]
    assert gen.attributes[genai.APPENDS] >= 3 and gen.attributes[genai.APPEND_MAX_SECONDS] > 0
    assert len(receiver.trace(trace_id)) <= 8, [s.name for s in receiver.trace(trace_id)]
    # The read: its own trace (the client sent none), linked to the create's span, with what it served.
    read_span = receiver.wait_spans(lambda s: s.attributes.get(genai.RESPONSE_ID) == sid
                                    and s.attributes.get(genai.OPERATION) == genai.FETCH_RESPONSE)[0]
    assert read_span.links == [(trace_id, create_span.span_id)] and read_span.trace_id != trace_id
    assert read_span.attributes[genai.EVENTS_SERVED] == len(read.events)
    assert genai.RESUME_FROM not in read_span.attributes and genai.INPUT_TOKENS not in read_span.attributes
    assert read_span.parent_id  # under its request's span: GET /v1/streams/{stream_id}/events
    get = receiver.wait_spans(lambda s: s.span_id == read_span.parent_id)[0]
    assert get.name == "GET /v1/streams/{stream_id}/events" and get.attributes["http.response.status_code"] == 200
    assert not receiver.where(lambda s: s.attributes.get("url.path") == "/healthz")  # probes: no spans
    # The generator's log lines of the generation lead to it.
    logged = [orjson.loads(line) for line in traced.procs[0].output().splitlines() if sid in line]
    assert any(rec.get("msg") == "finished" and rec.get("trace_id") == trace_id for rec in logged), logged


@pytest.mark.slow
def test_a_prompt_served_from_the_cache_says_how_much_in_its_span(traced: Stack, receiver: OtlpReceiver) -> None:
    # The conventions' cached input tokens: what the engine's prompt cache served of the prompt, as usage says it.
    prompt = "Here is a long preamble that a chat sends again with every turn. " * 20
    spans = []
    with traced.client() as c:
        for _ in range(2):
            header, trace_id, _ = traceparent()
            r = c.post("/v1/streams", headers={"traceparent": header}, json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0})
            assert r.status_code == 201, r.text
            usage = read_sse(c, f"/v1/streams/{r.json()['id']}/events").events[-1].data["usage"]
            def of_this_trace(s: Span, t: str = trace_id) -> bool:
                return s.trace_id == t and _generation(s)

            gen = receiver.wait_spans(of_this_trace)[0]
            spans.append((gen.attributes[genai.CACHED_INPUT_TOKENS], usage["cached_tokens"], usage["prompt_tokens"]))
    (first, first_usage, _), (second, second_usage, prompt_tokens) = spans
    assert (first, second) == (first_usage, second_usage)
    assert first == 0 and 0 < second <= prompt_tokens


@pytest.mark.slow
def test_a_resume_is_a_fetch_response_span_linked_to_the_generation(traced: TracedStack,
                                                                     receiver: OtlpReceiver) -> None:
    header, trace_id, _ = traceparent()
    read_header, read_trace, read_parent = traceparent()
    with traced.client() as c:
        sid = c.post("/v1/streams", headers={"traceparent": header},
                     json={"prompt": "Hi", "max_tokens": 40}).json()["id"]
        first = read_sse(c, f"/v1/streams/{sid}/events")
        resume_at = first.ids[3]
        again = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": resume_at,
                                                                  "traceparent": read_header})
    assert again.ids == first.ids[4:]
    create_span = receiver.wait_spans(lambda s: s.trace_id == trace_id and s.name == "POST /v1/streams")[0]
    try:
        resumed = receiver.wait_spans(lambda s: s.trace_id == read_trace and s.name.startswith("fetch_response"))[0]
    except AssertionError as e:
        reads = [(s.name, s.trace_id, s.parent_id, s.attributes.get(genai.RESUME_FROM)) for s in receiver.spans
                 if s.name.startswith(("fetch_response", "GET"))]
        raise AssertionError(f"{e}\nresume {read_trace} from {resume_at}; the reads' spans (name, trace, parent, "
                             f"resumed from): {reads}\nthe exporters said: {traced.export_failures()}") from None
    assert resumed.attributes[genai.RESUME_FROM] == resume_at
    assert resumed.attributes[genai.EVENTS_SERVED] == len(again.events)
    assert resumed.links == [(trace_id, create_span.span_id)]
    get = receiver.wait_spans(lambda s: s.span_id == resumed.parent_id)[0]
    assert get.parent_id == read_parent  # the reader's own trace, continued


@pytest.mark.slow
def test_a_cancelled_generation_has_its_error_type(traced: Stack, receiver: OtlpReceiver) -> None:
    header, trace_id, _ = traceparent()
    with traced.client() as c:
        sid = c.post("/v1/streams", headers={"traceparent": header},
                     json={"prompt": "Go on forever", "max_tokens": 4000}).json()["id"]

        def cancel_at_the_first_delta(event: SSE) -> None:
            if event.event == "delta":
                c.post(f"/v1/streams/{sid}/cancel")

        read = read_sse(c, f"/v1/streams/{sid}/events", on_event=cancel_at_the_first_delta)
    assert read.events[-1].event == "cancelled"
    gen = receiver.wait_spans(lambda s: s.trace_id == trace_id and _generation(s))[0]
    assert (gen.attributes[genai.ERROR_TYPE], gen.attributes[genai.CANCEL_REASON], gen.status) == (
        "cancelled", "client", ERROR)
    assert gen.attributes[genai.OUTPUT_TOKENS] == read.events[-1].data["usage"]["completion_tokens"] < 4000


@pytest.mark.slow
def test_the_generation_metrics_go_out_under_the_conventions_names(traced: Stack, receiver: OtlpReceiver) -> None:
    with traced.client() as c:
        sid = create(c, max_tokens=20).json()["id"]
        assert read_sse(c, f"/v1/streams/{sid}/events").events[-1].event == "done"
    wanted = {h.name for h in (genai.TIME_TO_FIRST_TOKEN, genai.TIME_PER_OUTPUT_TOKEN, genai.REQUEST_DURATION,
                               genai.TOKEN_USAGE, genai.QUEUE_WAIT)}

    def arrived() -> bool:
        assert wanted <= receiver.metric_names("rsb-generator"), receiver.metric_names()
        return True

    eventually(arrived, 30)
    types = {attrs.get(genai.TOKEN_TYPE) for _, name, attrs in receiver.metrics if name == genai.TOKEN_USAGE.name}
    assert types == {"input", "output"}


@pytest.mark.slow
def test_a_generator_killed_mid_answer_continues_as_attempt_2_of_the_same_trace_and_the_upstream_sees_it(
        demo_model: Path, tmp_path: Path, receiver: OtlpReceiver) -> None:
    from scripted_upstream import Reply, ScriptedUpstream, text

    answer = "".join(f"w{i} " for i in range(80))

    def respond(body: dict[str, object]) -> Reply:
        """The answer's rest after what the prompt holds (a continuation asks with the answer so far after it)."""
        so_far = str(body["prompt"]).removeprefix("Count")
        assert answer.startswith(so_far), so_far
        return Reply([text(w + " ") for w in answer[len(so_far):].split()], delay_s=0.03)

    header, trace_id, _ = traceparent()
    server = RedisServer().start()
    # The operator opted in to content on spans (the conventions' switch).
    s = TracedStack(server.url, demo_model, tmp_path, exporting_to(
        receiver.url, OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true"))
    try:
        with ScriptedUpstream() as up:
            up.respond = respond
            s.consumer()
            victim = s.generator("--upstream", up.url, "--lease-s", "1", ignore_eos=False)
            with s.client() as c:
                sid = c.post("/v1/streams", headers={"traceparent": header},
                             json={"prompt": "Count", "max_tokens": 500, "temperature": 0}).json()["id"]
                head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=8)
                assert head.events[-1].event == "delta"
                killed_ns = time.time_ns()
                victim.signal(signal.SIGKILL)
                victim.wait(5)
                s.generator("--upstream", up.url, "--lease-s", "1", ignore_eos=False)
                read = read_sse(c, f"/v1/streams/{sid}/events")
                up.script(Reply([], status=500, error="the model is on fire"))
                failed_header, failed_trace, _ = traceparent()
                failed = c.post("/v1/streams", headers={"traceparent": failed_header},
                                json={"prompt": "Count", "max_tokens": 50}).json()["id"]
                error = read_sse(c, f"/v1/streams/{failed}/events").events[-1]
            requests = up.requests
    finally:
        s.close()
        server.cleanup()
    assert read.events[-1].event == "done"
    assert "".join(e.data["text"] for e in read.events if e.event == "delta") == answer
    create_span = receiver.wait_spans(lambda x: x.trace_id == trace_id and x.name == "POST /v1/streams")[0]
    second = receiver.wait_spans(lambda x: x.trace_id == trace_id and _generation(x)
                                 and x.attributes[genai.ATTEMPT] == 2)[0]
    assert second.parent_id == create_span.span_id and second.attributes[genai.CONTINUED_FROM] > 0
    assert second.attributes[genai.OUTPUT_TOKENS] == read.events[-1].data["usage"]["completion_tokens"]
    assert _one(receiver.trace(trace_id), "time to first token").parent_id == second.span_id
    # Each attempt's request carried the trace to the upstream; the second's parent is its client span.
    chats = [r for r in requests if r.path == "/v1/completions"][:2]  # (the third: the failing stream's)
    assert all(r.headers["traceparent"].split("-")[1] == trace_id for r in chats), [r.headers for r in chats]
    client_span = receiver.wait_spans(lambda x: x.span_id == chats[1].headers["traceparent"].split("-")[2])[0]
    assert client_span.kind == CLIENT and client_span.parent_id == second.span_id
    assert client_span.attributes[genai.SERVER_PORT] == up.port and client_span.attributes[genai.PROVIDER] == "openai"
    assert client_span.attributes["http.response.status_code"] == 200
    # Opted in: the prompt and the whole answer (the lost attempt's part included, read back from the stream).
    assert orjson.loads(second.attributes[genai.INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "Count"}]}]
    assert orjson.loads(second.attributes[genai.OUTPUT_MESSAGES]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": answer}], "finish_reason": "stop"}]
    if os.environ.get("RSB_TRACE_DUMP"):  # docs/operations.md's picture: scripts/trace_waterfall.py draws it
        reads = receiver.wait_spans(lambda x: any(link[0] == trace_id for link in x.links), 2)
        Path(os.environ["RSB_TRACE_DUMP"]).write_text(orjson.dumps({
            "title": "one generation: created, queued, attempt 1 SIGKILLed mid-answer, continued by attempt 2",
            "spans": [dataclasses.asdict(x) for x in receiver.trace(trace_id) + reads],
            "marks": [("generator SIGKILLed", killed_ns)],
            "lost": [("attempt 1 (SIGKILLed)",
                      _one(receiver.trace(trace_id), "queue wait").end_ns, killed_ns)]},
            option=orjson.OPT_INDENT_2).decode())
    # A failure: error.type on the generation (its error event's code) and on the upstream call (the HTTP status).
    assert error.event == "error"
    failing = receiver.wait_spans(lambda x: x.trace_id == failed_trace and _generation(x))[0]
    assert (failing.attributes[genai.ERROR_TYPE], failing.status) == (error.data["code"], ERROR)
    call = receiver.wait_spans(lambda x: x.trace_id == failed_trace and x.kind == CLIENT)[0]
    assert (call.attributes[genai.ERROR_TYPE], call.status) == ("500", ERROR)


@pytest.mark.slow
def test_a_job_handed_over_at_shutdown_ends_its_attempt_and_the_next_continues_the_trace(
        demo_model: Path, tmp_path: Path, receiver: OtlpReceiver) -> None:
    """A generator stopped past its grace hands the job over: its attempt's span ends (handed_over) and leaves with
    the process's last export; the next generator's attempt 2 is the same trace's."""
    from scripted_upstream import Reply, ScriptedUpstream, text

    header, trace_id, _ = traceparent()
    server = RedisServer().start()
    s = TracedStack(server.url, demo_model, tmp_path, exporting_to(receiver.url))
    try:
        with ScriptedUpstream() as up:
            up.respond = lambda body: Reply([text(f"w{i} ") for i in range(60)], delay_s=0.03)
            s.consumer()
            first = s.generator("--upstream", up.url, "--generator-grace-s", "0.2", ignore_eos=False)
            with s.client() as c:
                sid = c.post("/v1/streams", headers={"traceparent": header},
                             json={"messages": [{"role": "user", "content": "Count"}], "max_tokens": 500}).json()["id"]
                read_sse(c, f"/v1/streams/{sid}/events", stop_after=6)
                first.signal(signal.SIGTERM)
                assert first.wait(30) == 0
                s.generator("--upstream", up.url, ignore_eos=False)
                assert read_sse(c, f"/v1/streams/{sid}/events").events[-1].event == "done"
    finally:
        s.close()
        server.cleanup()
    attempts = receiver.wait_spans(lambda x: x.trace_id == trace_id and _generation(x), 2)
    by_attempt = {x.attributes[genai.ATTEMPT]: x for x in attempts}
    assert by_attempt[1].attributes[genai.ERROR_TYPE] == "handed_over" and by_attempt[1].status == ERROR
    assert genai.ERROR_TYPE not in by_attempt[2].attributes
    assert by_attempt[1].parent_id == by_attempt[2].parent_id  # both under the create's span
    assert by_attempt[1].end_ns <= by_attempt[2].start_ns


def _workload(s: Stack, streams: int = 3, max_tokens: int = 300) -> float:
    """Streams one after the other, each read to its end: the seconds they took in all."""
    t0 = time.monotonic()
    with s.client() as c:
        for _ in range(streams):
            header, _, _ = traceparent()
            sid = c.post("/v1/streams", headers={"traceparent": header},
                         json={"prompt": "Go on", "max_tokens": max_tokens}).json()["id"]
            read = read_sse(c, f"/v1/streams/{sid}/events")
            assert read.events[-1].event == "done" and read.events[-1].data["usage"]["completion_tokens"] == max_tokens
    return time.monotonic() - t0


def _stop(procs: list[Proc]) -> float:
    """SIGTERM each, as an orchestrator does: the seconds until the last exited (each with status 0)."""
    t0 = time.monotonic()
    for p in procs:
        p.signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(30) == 0, p.output()[-2000:]
    return time.monotonic() - t0


@pytest.mark.slow
def test_disabled_nothing_is_sent_and_a_collector_that_is_down_costs_the_streams_nothing(
        demo_model: Path, tmp_path: Path) -> None:
    """The same streams, on a stack with the SDK disabled (nothing reaches a receiver that is up, nothing fails),
    then on one exporting to a collector that accepts connections and never answers (exports time out after 60 s):
    they take about as long as on the first stack, never an export's timeout, and the processes still stop
    promptly."""
    quiet = OtlpReceiver().start()
    hole = Blackhole()
    server = RedisServer().start()
    (tmp_path / "off").mkdir()
    (tmp_path / "down").mkdir()
    off = TracedStack(server.url, demo_model, tmp_path / "off", exporting_to(quiet.url, OTEL_SDK_DISABLED="true"))
    down = TracedStack(server.url, demo_model, tmp_path / "down", exporting_to(
        hole.url, OTEL_BSP_SCHEDULE_DELAY="20", OTEL_EXPORTER_OTLP_TIMEOUT="60"))
    try:
        gen = off.generator()
        api, _ = off.consumer()
        _workload(off, streams=1)  # warm: the first model load and connections
        baseline = _workload(off)
        baseline_stop = _stop([gen, api])
        assert quiet.requests == 0 and quiet.spans == []  # a clean stop flushes whatever a live SDK held: none
        assert "trace_id" not in gen.output() and "trace_id" not in api.output()

        gen = down.generator()
        api, _ = down.consumer()
        _workload(down, streams=1)
        stalled = _workload(down)
        assert hole.connections >= 1  # the exporters did try, and hang there
        # A stream that waited on an export would wait its timeout (60 s); a busy machine slows the run a few times.
        assert stalled < 4 * baseline + 10.0, (stalled, baseline)
        # An exit waits for its last exports a bounded time (broker.telemetry.SHUTDOWN_TIMEOUT_S per signal), not the
        # SDK's 30 s nor the export's timeout.
        assert _stop([gen, api]) < baseline_stop + 2 * telemetry.SHUTDOWN_TIMEOUT_S + 10.0
    finally:
        off.close()
        down.close()
        server.cleanup()
        hole.close()
        quiet.stop()


@pytest.mark.slow
def test_rsb_up_exports_one_trace_per_generation(demo_model: Path, tmp_path: Path, receiver: OtlpReceiver) -> None:
    port = free_port()
    up = Proc([sys.executable, "-m", "rsb", "up", "--port", str(port), "--model", str(demo_model), "--ignore-eos"],
              "up", log_path=tmp_path / "up.log", env={"RSB_CACHE_DIR": str(tmp_path / "cache"),
                                                      **exporting_to(receiver.url)})
    try:
        up.wait_for_line(f"rsb is up: http://127.0.0.1:{port}", 60)
        header, trace_id, client_span = traceparent()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            sid = c.post("/v1/streams", headers={"traceparent": header},
                         json={"prompt": "Hi", "max_tokens": 30}).json()["id"]
            assert read_sse(c, f"/v1/streams/{sid}/events").events[-1].event == "done"
        spans = receiver.wait_spans(lambda s: s.trace_id == trace_id and s.name in ("POST /v1/streams", "decode"), 2)
        by_name = {s.name: s for s in spans}
        assert by_name["POST /v1/streams"].parent_id == client_span
        assert by_name["POST /v1/streams"].service == "rsb-consumer" and by_name["decode"].service == "rsb-generator"
    finally:
        up.signal(signal.SIGTERM)
        up.wait(30)
        up.kill()


@pytest.mark.slow
def test_rsb_up_with_an_endpoint_and_no_sdk_says_what_to_install(tmp_path: Path) -> None:
    port = free_port()
    code = "import sys; sys.modules['opentelemetry'] = None; from rsb.cli import main; sys.exit(main())"
    p = Proc([sys.executable, "-c", code, "up", "--port", str(port)], "up", log_path=tmp_path / "up.log",
             env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    try:
        assert p.wait(60) == 1
    finally:
        p.kill()
    out = p.output()
    assert out.rstrip().splitlines()[-1] == ("rsb up: OTEL_EXPORTER_OTLP_ENDPOINT asks for OpenTelemetry and its SDK "
                                            "is not installed: pip install 'rsb[otel]'"), out
    assert "Traceback" not in out


# -- the switches ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "traces", "metrics"), [
    ({}, (), ()),  # nothing configured: off (the SDK alone would send to localhost:4318)
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ("otlp",), ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",), ()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "none"}, ("otlp",), ()),
    ({"OTEL_TRACES_EXPORTER": "console"}, ("console",), ()),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "otlp"}, ("otlp", "console"), ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, (), ()),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, (), ()),
])
def test_what_the_sdk_variables_turn_on(env: dict[str, str], traces: tuple[str, ...],
                                        metrics: tuple[str, ...]) -> None:
    want = telemetry.wanted(env)
    assert (want.traces, want.metrics) == (traces, metrics)


@pytest.mark.parametrize(("env", "says"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unknown OpenTelemetry exporter 'zipkin': rsb exports otlp, console or none"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported: use http/protobuf (or grpc)"),
])
def test_what_rsb_cannot_send_is_one_line(env: dict[str, str], says: str) -> None:
    with pytest.raises(telemetry.TelemetryMissing) as e:
        telemetry.check(env)
    assert str(e.value) == says


def test_off_it_costs_one_test_and_imports_nothing() -> None:
    """Without an exporter configured, setup starts nothing: no tracer, no meter, no traceparent, no log ids."""
    assert telemetry.setup("rsb-test", env={}) is telemetry.NOTHING
    assert telemetry.TRACER is None and telemetry.METER is None
    assert telemetry.traceparent() == "" and telemetry.log_ids() is None and telemetry.remote_parent("00-x") is None


def test_the_prometheus_names_are_what_a_collector_makes_of_the_conventions_names() -> None:
    assert genai.prometheus_name(genai.TIME_TO_FIRST_TOKEN) == "gen_ai_server_time_to_first_token_seconds"
    assert genai.prometheus_name(genai.TOKEN_USAGE) == "gen_ai_client_token_usage"
    assert genai.prometheus_name(genai.QUEUE_WAIT) == "rsb_generator_queue_wait_seconds"
    assert genai.label(genai.REQUEST_MODEL) == "gen_ai_request_model"

