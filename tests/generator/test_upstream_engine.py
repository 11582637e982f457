"""The upstream engine (``rsb generator --upstream URL``) against a real OpenAI-compatible server:
llama-cpp-python's own (``python3 -m llama_cpp.server``) on the demo models, started as a process.

Ollama's native API has no real server here (Ollama is not installable from the registries this project
uses), so its request and response translation is tested as pure functions only; no fake stands in for it.

llama-cpp-python's server runs one request at a time (the others wait for its lock) and reports no usage
when streaming. Greedy sampling (temperature 0) makes its answers repeatable, so what arrives through rsb
can be compared with what the server answers directly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from helpers import SSE, create, eventually, read_sse, until, wait_status
from servers import StackFactory

from bench.procs import wait_serving
from broker.redis.server import RedisServer, free_port
from broker.request.generation import GenerationRequest, Message, prompt_token_bound
from generator.engines import Generation, UpstreamError
from generator.engines.pieces import Piece
from generator.engines.upstream import UpstreamEngine, detect_api
from generator.engines.upstream.ollama import OLLAMA, parse_line
from generator.engines.upstream.openai import OPENAI, parse_event
from generator.engines.upstream.protocol import (
    CONTINUE_INSTRUCTION,
    SurrogateJoiner,
    UpstreamGeneration,
    UpstreamRequest,
    stream_pieces,
)
from generator.handoff import StopSignal, TokenHandoff, produce


async def collect(gen: Generation) -> list[Piece]:
    """An on-loop generation's pieces, read to the end."""
    assert gen.apieces is not None
    return [p async for p in gen.apieces]


def openai_request(request: GenerationRequest, **kw: Any) -> tuple[str, dict[str, Any]]:
    call: UpstreamRequest = OPENAI.build_request(request, **kw)
    return call.path, call.body


def ollama_request(request: GenerationRequest, **kw: Any) -> tuple[str, dict[str, Any]]:
    call: UpstreamRequest = OLLAMA.build_request(request, **kw)
    return call.path, call.body

STORY = [{"role": "user", "content": "Tell me a story"}]


class LlamaServer:
    """llama-cpp-python's OpenAI-compatible server, one process, on a free port."""

    def __init__(self, model: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")  # closed in stop()
        # --interrupt_requests False: by default a new request makes the one streaming end early, which
        # would cut answers short as soon as two generations overlap.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(self.port),
             "--n_threads", "1", "--n_ctx", "8192", "--interrupt_requests", "False", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_serving(f"{self.url}/v1/models", lambda: self.proc.poll() is None, self.output, 90)
        self.model_id = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def chat_posts(self) -> int:
        """Chat requests the server has received (its access log: headers go out before the lock is held)."""
        return self.output().count("POST /v1/chat/completions")

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Keep the server busy with a long answer for the duration of the block, so other requests wait
        in its queue. Asked with logprobs: then this server streams, and so notices the disconnect at the
        end of the block, token by token (without them it withholds every delta after the first invalid
        UTF-8 byte, which random weights produce early, and only notices at the end of the answer)."""
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", timeout=60, json={
                "messages": STORY, "max_tokens": 3000, "temperature": 0.0, "stream": True,
                "logprobs": True, "top_logprobs": 1}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: dropping a started iterator closes the connection
            next(lines)  # generating
            yield

    def assert_free(self) -> None:
        """A short request is answered at once: nothing else is left running or queued."""
        t0 = time.monotonic()
        self.chat([{"role": "user", "content": "hi"}], 4)
        assert time.monotonic() - t0 < 5.0

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """The same request answered directly (not streamed), greedy."""
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=120,
                       json={"messages": messages, "max_tokens": max_tokens, "temperature": 0.0})
        r.raise_for_status()
        return dict(r.json())

    def chat_deltas(self, messages: list[dict[str, str]], max_tokens: int) -> list[str]:
        """The same request streamed directly: the text of each delta, empty ones included."""
        deltas: list[str] = []
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", timeout=120, json={
                "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    content = json.loads(line[5:])["choices"][0]["delta"].get("content")
                    if content is not None:
                        deltas.append(content)
        return deltas

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0})
        r.raise_for_status()
        return dict(r.json())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def upstream(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = LlamaServer(demo_model, tmp_path_factory.mktemp("upstream") / "llama-server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_upstream(slow_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """On the larger demo model: its greedy answer to STORY runs thousands of tokens without an EOS."""
    server = LlamaServer(slow_model, tmp_path_factory.mktemp("slow-upstream") / "llama-server.log")
    yield server
    server.stop()


def _request(**kw: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"messages": None, "prompt": None, "model": None, "max_tokens": 16,
                              "temperature": 0.0, "top_p": 0.95, "seed": None, "stop": (),
                              "cancel_on_disconnect": False}
    fields.update(kw)
    return GenerationRequest(**fields)


def _chat_request(messages: list[dict[str, str]], **kw: Any) -> GenerationRequest:
    return _request(messages=tuple(Message(m["role"], m["content"]) for m in messages), **kw)


# -- translation, as pure functions ----------------------------------------------------------------


def test_openai_requests_carry_every_field() -> None:
    req = _chat_request(STORY, temperature=0.7, top_p=0.9, seed=42, stop=("\n\n", "END"))
    path, body = openai_request(req, prefix_text="", max_tokens=100, model="m")
    assert path == "/v1/chat/completions"
    assert body == {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 100,
                    "temperature": 0.7, "top_p": 0.9, "model": "m", "seed": 42, "stop": ["\n\n", "END"],
                    "messages": STORY, "prompt_cache_key": f"rsb-{req.affinity('')}"}
    path, body = openai_request(_request(prompt="Once"), prefix_text=" upon", max_tokens=5, model=None)
    assert path == "/v1/completions"
    assert body["prompt"] == "Once upon" and "model" not in body and "seed" not in body and "stop" not in body


def test_the_prompt_cache_key_sent_up_is_scoped_to_the_tenant() -> None:
    # Two tenants naming the same prompt_cache_key (or the same leading messages) must not be routed to one
    # upstream machine's cache by it: the key sent up is a digest within the cache scope, never the client's.
    req = _chat_request(STORY, prompt_cache_key="shared")
    keys = {scope: OPENAI.build_request(req, prefix_text="", max_tokens=5, model=None, cache_scope=scope)
            .body["prompt_cache_key"] for scope in ("alice", "bob", "")}
    assert len(set(keys.values())) == 3 and "shared" not in "".join(keys.values())
    again = OPENAI.build_request(req, prefix_text="", max_tokens=5, model=None, cache_scope="alice")
    assert again.body["prompt_cache_key"] == keys["alice"]  # stable: one tenant's turns still meet


def test_penalties_and_logit_bias_go_to_the_upstream() -> None:
    from broker.request.sampling import Sampling
    from generator.engines.base import EngineError

    sampling = Sampling(presence_penalty=0.5, frequency_penalty=-1.0, logit_bias=((42, -100.0),),
                        parallel_tool_calls=False, max_tool_calls=3)
    _, body = openai_request(_chat_request(STORY, sampling=sampling), prefix_text="", max_tokens=5, model=None)
    assert (body["presence_penalty"], body["frequency_penalty"], body["logit_bias"]) == (0.5, -1.0, {"42": -100.0})
    assert "max_tool_calls" not in body and "parallel_tool_calls" not in body  # no tools: nothing to bound
    _, body = ollama_request(_chat_request(STORY, sampling=Sampling(presence_penalty=0.5)), prefix_text="",
                             max_tokens=5, model="m")
    assert body["options"]["presence_penalty"] == 0.5
    with pytest.raises(EngineError, match="logit_bias"):
        ollama_request(_chat_request(STORY, sampling=sampling), prefix_text="", max_tokens=5, model="m")


def test_a_chat_continued_after_a_crash_asks_the_model_to_go_on() -> None:
    _, body = openai_request(_chat_request(STORY), prefix_text="Once upon", max_tokens=5, model=None)
    assert body["messages"] == [*STORY, {"role": "assistant", "content": "Once upon"},
                                {"role": "user", "content": CONTINUE_INSTRUCTION}]


def test_ollama_requests_map_to_options() -> None:
    req = _chat_request(STORY, temperature=0.2, top_p=0.5, seed=7, stop=("x",))
    path, body = ollama_request(req, prefix_text="", max_tokens=64, model="llama3")
    assert path == "/api/chat"
    assert body == {"model": "llama3", "stream": True, "messages": STORY,
                    "options": {"num_predict": 64, "temperature": 0.2, "top_p": 0.5, "seed": 7, "stop": ["x"]}}
    path, body = ollama_request(_request(prompt="Once"), prefix_text=" upon", max_tokens=3, model="llama3")
    assert path == "/api/generate"
    assert body["prompt"] == "Once upon" and body["raw"] is True and "seed" not in body["options"]


def test_openai_stream_records_are_read_as_tokens_ends_and_usage() -> None:
    role = parse_event('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', chat=True)
    assert role.piece is None  # the turn's opening, not a token
    tok = parse_event('{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}', chat=True)
    assert tok.piece == "Hi" and tok.finish_reason is None
    partial = parse_event('{"choices":[{"delta":{"content":""},"finish_reason":null}]}', chat=True)
    assert partial.piece == ""  # a token that ends inside a character still counts
    end = parse_event('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}', chat=True)
    assert end.piece is None and end.finish_reason == "length" and end.stop_sequence is None
    # vLLM names the stop string that ended the answer (a stop token's id is a number: no stop sequence).
    stopped = parse_event('{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"END"}]}', chat=True)
    assert (stopped.finish_reason, stopped.stop_sequence) == ("stop", "END")
    token = parse_event('{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":128001}]}', chat=True)
    assert token.stop_sequence is None
    last = parse_event('{"choices":[{"index":0,"text":"!","finish_reason":"eos"}]}', chat=False)
    assert last.piece == "!" and last.finish_reason == "stop"
    usage = parse_event('{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30}}', chat=True)
    assert (usage.piece, usage.prompt_tokens, usage.completion_tokens) == (None, 12, 30)
    assert parse_event("[DONE]", chat=True).done
    with pytest.raises(UpstreamError, match="out of memory") as e:
        parse_event('{"error":{"message":"out of memory","code":500}}', chat=True)
    assert e.value.code == "upstream"


def test_ollama_stream_lines_are_read_as_tokens_ends_and_usage() -> None:
    tok = parse_line('{"model":"m","message":{"role":"assistant","content":"Hi"},"done":false}', chat=True)
    assert tok.piece == "Hi" and not tok.done
    gen = parse_line('{"model":"m","response":" there","done":false}', chat=False)
    assert gen.piece == " there"
    end = parse_line('{"model":"m","response":"","done":true,"done_reason":"length",'
                            '"prompt_eval_count":9,"eval_count":20}', chat=False)
    assert (end.piece, end.finish_reason, end.prompt_tokens, end.completion_tokens, end.done) == (
        None, "length", 9, 20, True)
    stop = parse_line('{"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop"}',
                             chat=True)
    assert stop.finish_reason == "stop"
    with pytest.raises(UpstreamError, match="model 'x' not found"):
        parse_line('{"error":"model \'x\' not found"}', chat=True)


def _sse(*records: str) -> list[str]:
    return [line for r in records for line in (f"data: {r}", "")]


def test_tokens_merged_into_one_delta_are_counted_from_the_reported_usage() -> None:
    """vLLM's shape: role opening, deltas (one carrying two tokens), the finish, then include_usage."""
    lines = [": keep-alive", "", *_sse(
        '{"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
        '{"choices":[{"delta":{"content":"Hel"},"finish_reason":null}]}',
        '{"choices":[{"delta":{"content":""},"finish_reason":null}]}',
        '{"choices":[{"delta":{"content":"lo \u00e9"},"finish_reason":null}]}',
        '{"choices":[{"delta":{"content":"!"},"finish_reason":"length"}]}',
        '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}',
        "[DONE]")]
    gen = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
    pieces = list(stream_pieces(OPENAI.chunks(lines, chat=True), generation=gen, max_tokens=4,
                                stop=threading.Event()))
    assert pieces == ["Hel", "lo \u00e9", "!", ""]
    assert (gen.prompt_tokens, gen.completion_tokens, gen.finish_reason) == (5, 4, "length")


def test_ollama_lines_become_pieces_and_counts() -> None:
    lines = ['{"message":{"role":"assistant","content":"Hi"},"done":false}',
             '{"message":{"role":"assistant","content":" you"},"done":false}', "",
             '{"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop",'
             '"prompt_eval_count":7,"eval_count":2}']
    gen = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
    assert list(stream_pieces(OLLAMA.chunks(lines, chat=True), generation=gen, max_tokens=10,
                              stop=threading.Event())) == ["Hi", " you"]
    assert (gen.prompt_tokens, gen.completion_tokens, gen.finish_reason) == (7, 2, "stop")


def test_a_stream_cut_before_its_end_is_an_error_unless_we_stopped_it() -> None:
    lines = _sse('{"choices":[{"text":"a","finish_reason":null}]}')
    gen = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
    with pytest.raises(UpstreamError, match="before the answer ended"):
        list(stream_pieces(OPENAI.chunks(lines, chat=False), generation=gen, max_tokens=10, stop=threading.Event()))
    stop = threading.Event()
    stop.set()
    assert list(stream_pieces(OPENAI.chunks(lines, chat=False), generation=gen, max_tokens=10, stop=stop)) == []


def test_the_protocol_comes_from_the_flag_or_the_url() -> None:
    assert detect_api("http://h:8000") is OPENAI
    assert detect_api("http://h:11434/api") is OLLAMA
    assert detect_api("http://h:11434", "ollama") is OLLAMA
    with pytest.raises(ValueError):
        detect_api("http://h", "grpc")
    assert OPENAI.base_url("http://h:8000/v1/") == "http://h:8000"
    assert OLLAMA.base_url("http://h:11434/api") == "http://h:11434"


def test_a_character_split_into_two_escaped_surrogates_comes_out_whole() -> None:
    j = SurrogateJoiner()
    assert j.push("a\ud83d") == "a"
    assert j.push("\ude00b") == "\U0001f600b"
    assert j.push("\ud83d") == "" and j.flush() == "\ufffd"


# -- the engine against a real server -----------------------------------------------------------


@pytest.mark.slow
async def test_the_engine_streams_what_the_upstream_generates(upstream: LlamaServer) -> None:
    engine = UpstreamEngine(upstream.url + "/v1")
    try:
        assert engine.name == upstream.model_id  # listed by the server
        gen = engine.start(_chat_request(STORY), prefix_text="", max_tokens=200, stop=threading.Event())
        pieces = await collect(gen)
        direct = await asyncio.to_thread(upstream.chat, STORY, 200)
        assert "".join(map(str, pieces)) == direct["choices"][0]["message"]["content"]
        assert gen.finish_reason == direct["choices"][0]["finish_reason"] == "length"
        # No usage when this server streams: one piece per delta with text (it sends empty ones too, and
        # merges a token that ends inside a character into the next).
        deltas = await asyncio.to_thread(upstream.chat_deltas, STORY, 200)
        assert pieces == [d for d in deltas if d] and len(pieces) <= 200

        # A prompt continued after a crash: completed exactly as the prompt plus the answer so far.
        gen = engine.start(_request(prompt="Hello"), prefix_text=" the", max_tokens=30, stop=threading.Event())
        text = "".join(map(str, await collect(gen)))
        assert text == (await asyncio.to_thread(upstream.complete, "Hello the", 30))["choices"][0]["text"]
    finally:
        engine.close()


@pytest.mark.slow
async def test_stop_aborts_a_request_still_waiting_in_the_upstream(slow_upstream: LlamaServer) -> None:
    """Our request waits in the server's queue with nothing to read: setting stop must still end it at once
    (the producing task is cancelled, which closes the connection), and the server must drop it, not run it
    once it is free."""
    engine = UpstreamEngine(slow_upstream.url)
    try:
        with slow_upstream.busy():
            posts = slow_upstream.chat_posts()
            stop = StopSignal()
            handoff = TokenHandoff(asyncio.get_running_loop(), 64)
            producer = produce(engine, _chat_request(STORY), handoff, prefix_text="", max_tokens=3000, stop=stop)
            await until(lambda: slow_upstream.chat_posts() != posts, 10, "our request at the server, waiting")
            await asyncio.sleep(0.3)  # deliberate: a moment in which the waiting request must not end by itself
            assert not producer.done()
            t0 = time.monotonic()
            stop.set()
            await asyncio.wait_for(asyncio.gather(producer, return_exceptions=True), 2.0)
            assert time.monotonic() - t0 < 2.0
            batch = await handoff.get(timeout_s=0)
            assert batch.closed and batch.pieces == []
        # Had our request stayed queued, it would now run its 3000 tokens ahead of this one.
        await asyncio.to_thread(slow_upstream.assert_free)
    finally:
        engine.close()


@pytest.mark.slow
async def test_an_http_error_from_the_upstream_is_an_upstream_error(upstream: LlamaServer) -> None:
    engine = UpstreamEngine(upstream.url)
    try:
        # 8192-token context: a prompt this long plus max_tokens cannot fit, and the server says so.
        gen = engine.start(_request(prompt="the " * 9000), prefix_text="", max_tokens=4, stop=threading.Event())
        with pytest.raises(UpstreamError) as e:
            await collect(gen)
        assert e.value.code == "upstream" and "upstream" in str(e.value)
    finally:
        engine.close()


# -- rsb generator --upstream, end to end ------------------------------------------------------


@pytest.mark.slow
def test_cancel_aborts_the_upstream_request(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_upstream: LlamaServer) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--upstream", slow_upstream.url, ignore_eos=False)
    with s.client() as c, slow_upstream.busy():
        posts = slow_upstream.chat_posts()
        sid = create(c, messages=STORY, max_tokens=3000, temperature=0.0).json()["id"]
        eventually(lambda: slow_upstream.chat_posts() != posts, 30, "the generation at the upstream, in its queue")
        assert c.get(f"/v1/streams/{sid}").json()["status"] == "running"
        t0 = time.monotonic()
        assert c.post(f"/v1/streams/{sid}/cancel").status_code == 202
        read = read_sse(c, f"/v1/streams/{sid}/events", timeout_s=10)
        assert time.monotonic() - t0 < 5.0
    end = read.events[-1]
    assert end.event == "cancelled" and end.data["reason"] == "client"
    assert end.data["usage"]["completion_tokens"] == 0
    # The upstream dropped the request: had it stayed queued, it would now be generating 3000 tokens.
    slow_upstream.assert_free()


@pytest.mark.slow
def test_concurrency_two_runs_two_generations_at_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_upstream: LlamaServer) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--upstream", slow_upstream.url, "--concurrency", "2", ignore_eos=False)
    with s.client() as c:
        with slow_upstream.busy():  # both generations wait at the upstream while it is busy
            posts = slow_upstream.chat_posts()
            sids = [create(c, messages=STORY, max_tokens=40, temperature=0.0).json()["id"] for _ in range(2)]

            def both_open() -> bool:  # one worker process has both requests open
                assert slow_upstream.chat_posts() >= posts + 2, slow_upstream.output()[-2000:]
                return True

            eventually(both_open, 30)
            assert [c.get(f"/v1/streams/{sid}").json()["status"] for sid in sids] == ["running", "running"]
        reads = [read_sse(c, f"/v1/streams/{sid}/events") for sid in sids]
    answer = slow_upstream.chat(STORY, 40)["choices"][0]["message"]["content"]
    for read in reads:  # greedy: both the upstream's whole answer, neither cut short by the other
        assert read.events[-1].event == "done" and read.events[-1].data["finish_reason"] == "length"
        assert read.text == answer


@pytest.mark.slow
def test_an_unreachable_upstream_ends_the_stream_with_error(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--upstream", f"http://127.0.0.1:{free_port()}", ignore_eos=False)
    with s.client() as c:
        sid = create(c, prompt="Hello", max_tokens=8).json()["id"]
        read = read_sse(c, f"/v1/streams/{sid}/events", timeout_s=30)
        st = wait_status(c, sid, {"error"})
    end = read.events[-1]
    assert end.event == "error" and end.data["code"] == "upstream"
    assert "unreachable" in end.data["message"] or "Connect" in end.data["message"]
    assert st["status"] == "error"


# -- typed output: tools, reasoning, structured output -------------------------------------------------------

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]
ARGS = '{"city": "Paris", "unit": "celsius"}'


def _typed_request(**body: Any) -> GenerationRequest:
    from broker.request.generation import RequestLimits, validate_create_body

    body.setdefault("messages", CALL_HISTORY)
    return validate_create_body(body, RequestLimits())[1]


def test_openai_requests_carry_tools_tool_choice_formats_and_the_tool_history() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}
    req = _typed_request(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         response_format=None)
    _, body = openai_request(req, prefix_text="", max_tokens=50, model=None)
    assert body["messages"] == CALL_HISTORY
    assert body["tools"] == [WEATHER_TOOL]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    _, body = openai_request(_typed_request(response_format=fmt), prefix_text="", max_tokens=50, model=None)
    assert body["response_format"] == fmt and "tools" not in body and "tool_choice" not in body


def test_ollama_requests_carry_tools_format_and_the_tool_history_as_ollama_reads_it() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    req = _typed_request(tools=[WEATHER_TOOL],
                         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    _, body = ollama_request(req, prefix_text="", max_tokens=50, model="qwen3")
    assert body["format"] == schema and body["tools"] == [WEATHER_TOOL]
    assert body["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert body["messages"][2] == {"role": "tool", "content": '{"temp_c": 21}', "tool_name": "get_weather"}
    _, body = ollama_request(_typed_request(response_format={"type": "json_object"}), prefix_text="",
                             max_tokens=5, model="m")
    assert body["format"] == "json" and "tools" not in body


def test_openai_records_carry_reasoning_and_tool_call_pieces() -> None:
    r = parse_event('{"choices":[{"delta":{"reasoning_content":"Hmm"},"finish_reason":null}]}', chat=True)
    assert (r.reasoning, r.piece) == ("Hmm", None)
    assert parse_event('{"choices":[{"delta":{"reasoning":"Hm"}}]}', chat=True).reasoning == "Hm"  # vLLM 0.10+
    start = parse_event('{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function",'
                        '"function":{"name":"get_weather"}}]}}]}', chat=True)
    assert [(c.index, c.id, c.name, c.arguments) for c in start.calls] == [(0, "c1", "get_weather", None)]
    args = parse_event('{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"ci"}}]}}]}',
                       chat=True)
    assert [(c.index, c.id, c.name, c.arguments) for c in args.calls] == [(0, None, None, '{"ci')]
    end = parse_event('{"choices":[{"delta":{"content":""},"finish_reason":"tool_calls"}]}', chat=True)
    assert end.finish_reason == "tool_calls" and end.piece is None


def _vllm_lines(*deltas: dict[str, Any], finish: str, completion_tokens: int | None = None) -> list[str]:
    """A chat completion stream exactly as vLLM writes it."""
    records: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    records += [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    records.append({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": finish}]})
    if completion_tokens is not None:
        records.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens}})
    return _sse(*(json.dumps(r) for r in records), "[DONE]")


def test_reasoning_and_tool_calls_become_markers_and_pieces() -> None:
    from generator.engines.pieces import REASONING, TEXT, Extra, ToolCallStart

    lines = _vllm_lines({"reasoning_content": "Let me"}, {"reasoning_content": " check."}, {"content": "Sure."},
                        {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "a"}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
                        {"tool_calls": [{"index": 1, "id": "c2", "type": "function",
                                         "function": {"name": "b", "arguments": "{}"}}]},
                        {"reasoning_content": "Done", "content": "!"},
                        finish="tool_calls", completion_tokens=9)
    gen = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
    pieces = list(stream_pieces(OPENAI.chunks(lines, chat=True), generation=gen, max_tokens=100,
                                stop=threading.Event()))
    assert pieces == [REASONING, "Let me", " check.", TEXT, "Sure.", ToolCallStart(0, "c1", "a"), '{"x":', " 1}",
                      ToolCallStart(1, "c2", "b"), "{}", REASONING, "Done", TEXT, Extra("!"), "", ""]
    assert gen.finish_reason == "tool_calls"
    # One token per record that carries text (the Extra "!" shares its record's): 7, and the usage says 9.
    assert sum(type(p) is str for p in pieces) == 9


def test_ollama_thinking_and_tool_calls_become_pieces_and_end_with_tool_calls() -> None:
    from generator.engines.pieces import REASONING, TEXT, ToolCallStart

    lines = ['{"message":{"role":"assistant","content":"","thinking":"Paris?"},"done":false}',
             '{"message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"get_weather",'
             '"arguments":{"city":"Paris"}}}]},"done":false}',
             '{"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop","eval_count":4}']
    gen = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
    pieces = list(stream_pieces(OLLAMA.chunks(lines, chat=True), generation=gen, max_tokens=10,
                                stop=threading.Event()))
    assert pieces[:2] == [REASONING, "Paris?"] and pieces[-2:] == ["", ""]
    start = pieces[2]
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "get_weather")
    assert start.id.startswith("call_") and pieces[3] == '{"city": "Paris"}'
    assert gen.finish_reason == "tool_calls" and TEXT not in pieces


def test_a_replayed_answer_skips_what_was_stored_and_refuses_a_different_one() -> None:
    from generator.engines.pieces import PartialAnswer, PartialCall
    from generator.engines.upstream.protocol import Replay

    lines = _vllm_lines({"reasoning_content": "Let me check."},
                        {"tool_calls": [{"index": 0, "id": "new-id", "type": "function", "function": {"name": "a"}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]},
                        {"tool_calls": [{"index": 0, "function": {"arguments": " 12}"}}]}, finish="tool_calls")
    stored = PartialAnswer("Let me check.", (PartialCall(0, "c1", "a", '{"x": 1'),), 0)
    gen = UpstreamGeneration(prompt_tokens=0, pieces=iter(()))
    pieces = list(stream_pieces(OPENAI.chunks(lines, chat=True), generation=gen, max_tokens=100,
                                stop=threading.Event(), replay=Replay("", stored)))
    assert pieces == ["2}"]  # the rest of call 0's arguments, in the kind the stored answer ended in
    different = PartialAnswer("Let me check.", (PartialCall(0, "c1", "a", '{"x": 7'),), 0)
    with pytest.raises(UpstreamError, match="differs from the stored one"):
        list(stream_pieces(OPENAI.chunks(lines, chat=True), generation=gen, max_tokens=100,
                           stop=threading.Event(), replay=Replay("", different)))
    renamed = PartialAnswer("", (PartialCall(0, "c1", "b", ""),), 0)
    with pytest.raises(UpstreamError, match="calls 'a' where it had called 'b'"):
        list(stream_pieces(OPENAI.chunks(lines, chat=True), generation=gen, max_tokens=100,
                           stop=threading.Event(), replay=Replay("", renamed)))


# -- typed output end to end: the scripted upstream behind a real generator ---------------------------------


def merged(events: list[SSE]) -> list[tuple[str, Any]]:
    """The stream's events after ``started``, consecutive pieces of one kind joined (how they are split into
    events depends on timing; what they add up to, and their order, may not)."""
    out: list[tuple[str, Any]] = []
    for e in events:
        if e.event in ("queued", "started"):
            continue
        if e.event in ("delta", "reasoning") and out and out[-1][0] == e.event:
            out[-1] = (e.event, out[-1][1] + e.data["text"])
        elif e.event == "tool_args" and out and out[-1][0] == "tool_args" and out[-1][1]["index"] == e.data["index"]:
            out[-1] = ("tool_args", {"index": e.data["index"], "text": out[-1][1]["text"] + e.data["text"]})
        elif e.event in ("delta", "reasoning"):
            out.append((str(e.event), e.data["text"]))
        else:
            out.append((str(e.event), e.data))
    return out


@pytest.mark.slow
def test_reasoning_and_a_tool_call_in_pieces_are_exact_native_events(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    from scripted_upstream import Reply, ScriptedUpstream, reasoning, text, tool_call_pieces

    with ScriptedUpstream() as up:
        up.script(Reply([reasoning("Let me"), reasoning(" think."), text("Checking."),
                         *tool_call_pieces(0, "call_abc", "get_weather", ARGS, piece_chars=5),
                         *tool_call_pieces(1, "call_def", "get_time", '{"tz": "CET"}', piece_chars=3)],
                        finish_reason="tool_calls", delay_s=0.02, usage={"prompt_tokens": 31, "completion_tokens": 20}))
        s = stack_factory(redis_server.url)
        s.consumer()
        s.generator("--upstream", up.url, ignore_eos=False)
        with s.client() as c:
            sid = create(c, messages=CALL_HISTORY, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="auto",
                         max_tokens=200).json()["id"]
            read = read_sse(c, f"/v1/streams/{sid}/events")
        sent = up.bodies()[0]
    assert sent["messages"] == CALL_HISTORY and sent["tools"] == [WEATHER_TOOL, TIME_TOOL] and "tool_choice" not in sent
    assert read.events[1].event == "started"
    assert read.events[1].data == {"model": "scripted-model", "service_tier": "default"}
    done = read.events[-1]
    assert merged(read.events[:-1]) == [
        ("reasoning", "Let me think."), ("delta", "Checking."),
        ("tool_call", {"index": 0, "id": "call_abc", "name": "get_weather"}), ("tool_args", {"index": 0, "text": ARGS}),
        ("tool_call", {"index": 1, "id": "call_def", "name": "get_time"}), ("tool_args", {"index": 1, "text": '{"tz": "CET"}'}),
    ]
    assert done.event == "done" and done.data["finish_reason"] == "tool_calls"
    assert (done.data["usage"]["prompt_tokens"], done.data["usage"]["completion_tokens"]) == (31, 20)
    assert len(read.ids) == len(set(read.ids))


@pytest.mark.slow
def test_a_generator_killed_inside_a_tool_call_is_replayed_without_a_piece_twice(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The upstream answers the same way twice (a deterministic sampler): the second generator asks again,
    checks the repeated part against the stream and skips it, and goes on from where the first stopped."""
    from scripted_upstream import Reply, ScriptedUpstream, reasoning, tool_call_pieces

    arguments = '{"city": "Paris", "days": [' + ", ".join(f'"day {i}"' for i in range(40)) + "]}"
    deltas = [reasoning("Paris, then."), *tool_call_pieces(0, "call_first", "get_weather", arguments, piece_chars=4)]
    with ScriptedUpstream() as up:
        up.respond = lambda body: Reply(deltas, finish_reason="tool_calls", delay_s=0.03)
        s = stack_factory(redis_server.url)
        s.consumer()
        victim = s.generator("--upstream", up.url, "--lease-s", "1", ignore_eos=False)
        with s.client() as c:
            sid = create(c, messages=CALL_HISTORY[:1], tools=[WEATHER_TOOL], temperature=0.0, seed=3,
                         max_tokens=500).json()["id"]
            head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=12)
            assert head.events[-1].event == "tool_args"  # inside the call's arguments
            victim.signal(signal.SIGKILL)
            victim.wait(5)
            s.generator("--upstream", up.url, "--lease-s", "1", ignore_eos=False)
            read = read_sse(c, f"/v1/streams/{sid}/events")
        bodies = up.bodies()
    assert len(bodies) == 2 and bodies[1]["messages"] == bodies[0]["messages"]  # asked again, as first asked
    assert bodies[1]["max_tokens"] == bodies[0]["max_tokens"] == 500
    assert merged(read.events[:-1]) == [
        ("reasoning", "Paris, then."), ("tool_call", {"index": 0, "id": "call_first", "name": "get_weather"}),
        ("tool_args", {"index": 0, "text": arguments})]
    json.loads(arguments)
    assert [e.event for e in read.events].count("started") == 1 and len(read.ids) == len(set(read.ids))
    assert read.events[-1].event == "done" and read.events[-1].data["finish_reason"] == "tool_calls"


@pytest.mark.slow
def test_a_replay_the_upstream_answers_differently_ends_with_an_upstream_error(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    from scripted_upstream import Reply, ScriptedUpstream, tool_call_pieces

    first = tool_call_pieces(0, "c1", "get_weather", '{"town": "Paris, France, Europe, Earth"}', piece_chars=2)
    second = tool_call_pieces(0, "c9", "get_weather", '{"city": "Lyon"}', piece_chars=2)
    with ScriptedUpstream() as up:
        up.script(Reply(first, finish_reason="tool_calls", delay_s=0.1), Reply(second, finish_reason="tool_calls"))
        s = stack_factory(redis_server.url)
        s.consumer()
        victim = s.generator("--upstream", up.url, "--lease-s", "1", ignore_eos=False)
        with s.client() as c:
            sid = create(c, messages=CALL_HISTORY[:1], tools=[WEATHER_TOOL], max_tokens=100).json()["id"]
            read_sse(c, f"/v1/streams/{sid}/events", stop_after=8)
            victim.signal(signal.SIGKILL)
            victim.wait(5)
            s.generator("--upstream", up.url, "--lease-s", "1", ignore_eos=False)
            read = read_sse(c, f"/v1/streams/{sid}/events")
    end = read.events[-1]
    assert end.event == "error" and end.data["code"] == "upstream" and "differs from the stored one" in end.data["message"]
    args = "".join(e.data["text"] for e in read.events if e.event == "tool_args")
    assert args.startswith('{"town": "') and "Lyon" not in args  # only the first answer's pieces


@pytest.fixture(scope="module")
def tools_upstream(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama-cpp-python's server with its tool-calling chat format (calls constrained by its own grammar)."""
    server = LlamaServer(demo_model, tmp_path_factory.mktemp("tools-upstream") / "llama-server.log",
                         "--chat_format", "chatml-function-calling")
    yield server
    server.stop()


@pytest.mark.slow
def test_a_real_llama_cpp_server_s_tool_call_streams_as_native_events(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        tools_upstream: LlamaServer) -> None:
    """This server repeats the call's id and name in every piece: one call all the same, its arguments whole."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator("--upstream", tools_upstream.url, ignore_eos=False)
    with s.client() as c:
        sid = create(c, messages=messages, tools=[tool], tool_choice=choice, max_tokens=60, temperature=0.0).json()["id"]
        read = read_sse(c, f"/v1/streams/{sid}/events")
    direct = httpx.post(f"{tools_upstream.url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "tools": [tool], "tool_choice": choice, "max_tokens": 60, "temperature": 0.0}).json()
    [call] = direct["choices"][0]["message"]["tool_calls"]
    events = merged(read.events[:-1])
    assert events == [("tool_call", {"index": 0, "id": events[0][1]["id"], "name": "get_weather"}),
                      ("tool_args", {"index": 0, "text": call["function"]["arguments"]})]
    assert events[0][1]["id"].startswith("call__0_get_weather")
    assert read.events[-1].event == "done" and read.events[-1].data["finish_reason"] == "tool_calls"


def test_an_openai_chunk_s_logprobs_become_markers_after_its_text() -> None:
    from generator.engines.pieces import TokenLogprob

    chunk = parse_event(json.dumps({"choices": [{"delta": {"content": "Hi"}, "logprobs": {"content": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "Yo", "logprob": -2.0}]}]}}]}), chat=True)
    assert chunk.piece == "Hi" and chunk.logprobs == (
        TokenLogprob("Hi", -0.5, (72, 105), (("Hi", -0.5, (72, 105)), ("Yo", -2.0, ()))),)


# -- the prompt is always counted (usage after the finish chunk; a cancel before any usage) ------------------


async def test_an_answer_that_spends_its_budget_reads_on_for_the_upstreams_usage() -> None:
    """vLLM and OpenAI send ``usage`` after the finish chunk: an answer cut by max_tokens still gets the prompt's
    count from it (the engine reads a bounded tail), not 0."""
    from scripted_upstream import Reply, ScriptedUpstream, text

    with ScriptedUpstream() as up:
        up.script(Reply([text(f" w{i}") for i in range(10)], usage={"prompt_tokens": 4321, "completion_tokens": 10}))
        engine = UpstreamEngine(up.url, model="scripted-model")
        request = _request(messages=(Message("user", "x" * 20_000),), max_tokens=2)
        gen = engine.start(request, prefix_text="", max_tokens=2, stop=StopSignal())
        pieces = await collect(gen)
    assert pieces == [" w0", " w1"] and gen.finish_reason == "length"
    assert gen.prompt_tokens == 4321


async def test_a_stream_with_no_usage_charges_the_prompts_bound() -> None:
    """An upstream that reports no usage (llama-cpp-python's server when streaming) charges the prompt's bound,
    never 0."""
    from scripted_upstream import Reply, ScriptedUpstream, text

    with ScriptedUpstream() as up:
        up.script(Reply([text("a"), text("b")], include_usage=False))
        engine = UpstreamEngine(up.url, model="scripted-model")
        request = _request(messages=(Message("user", "x" * 5_000),), max_tokens=1)
        gen = engine.start(request, prefix_text="", max_tokens=1, stop=StopSignal())
        assert await collect(gen) == ["a"]
    assert gen.prompt_tokens == prompt_token_bound(request.canonical_json()) > 5_000


async def test_a_prompt_the_upstream_finds_too_long_is_context_length_exceeded() -> None:
    """vLLM's 400 for a prompt past the model's context ends the stream with the code a local engine gives it (and
    the OpenAI chat view answers a 400 for), not a generic ``upstream`` error."""
    from scripted_upstream import Reply, ScriptedUpstream

    from generator.engines import error_code

    with ScriptedUpstream() as up:
        up.script(Reply([], status=400, error="This model's maximum context length is 2048 tokens. However, you "
                                              "requested 9000 tokens (8990 in the messages, 10 in the completion)."))
        engine = UpstreamEngine(up.url, model="scripted-model")
        gen = engine.start(_chat_request(STORY, max_tokens=10), prefix_text="", max_tokens=10,
                           stop=StopSignal())
        with pytest.raises(UpstreamError) as e:
            await collect(gen)
    assert error_code(e.value) == "context_length_exceeded" and "maximum context length" in str(e.value)


@pytest.mark.slow
def test_budgets_and_the_ledger_count_an_upstreams_prompt(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    """Issue 42's finding: large requests with max_tokens 1 were charged 1 token each (the usage came after the
    finish chunk, unread), so a budget admitted far more of them than it holds. Now each is charged the upstream's
    prompt count, the report shows it, and a cancelled generation, which gets no usage from the upstream, is
    charged its prompt's bound; the create that would pass the budget is refused."""
    from scripted_upstream import Reply, ScriptedUpstream, text

    from consumer.edge.auth import new_key

    prompt_tokens, big = 5_000, "word " * 4_000  # 20 KB of text, 5,000 tokens as the upstream counts them
    alice, entry = new_key("alice")
    reserve = prompt_token_bound(orjson.dumps(big)) + 200  # about what one create reserves (its JSON is a bit more)
    # Two settled (5,001 each) and one reservation fit; once that one is charged its bound, another does not.
    budget = 2 * (prompt_tokens + 1) + reserve + reserve // 2
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**entry, "token_budget": budget, "budget_period": "day"}]}))
    with ScriptedUpstream() as up:
        up.respond = lambda body: Reply([text(" yes")] * 5, usage={"prompt_tokens": prompt_tokens,
                                                                   "completion_tokens": 5})
        s = stack_factory(redis_server.url)
        s.consumer("--api-keys", str(keys))
        s.generator("--upstream", up.url, ignore_eos=False)
        with s.client() as c:
            c.headers["Authorization"] = f"Bearer {alice}"
            for _ in range(2):
                r = create(c, messages=[{"role": "user", "content": big}], max_tokens=1)
                assert r.status_code == 201, r.text
                done = read_sse(c, f"/v1/streams/{r.json()['id']}/events").events[-1]
                assert done.event == "done" and done.data["finish_reason"] == "length"
                assert (done.data["usage"]["prompt_tokens"], done.data["usage"]["completion_tokens"]) == (prompt_tokens, 1)
            # A third, held by an upstream that never ends, then cancelled: no usage ever comes from the upstream.
            up.script(Reply([text(" held")], hold=True))
            held = create(c, messages=[{"role": "user", "content": big}], max_tokens=1)
            assert held.status_code == 201, held.text
            hid = held.json()["id"]
            stored = redis_client.hget(f"rsb:{{p0}}:s:{hid}:meta", "req")
            assert isinstance(stored, bytes)
            up.wait_requests(3)
            assert c.post(f"/v1/streams/{hid}/cancel").status_code == 202
            end = read_sse(c, f"/v1/streams/{hid}/events").events[-1]
            # Charged 2 x 5,001 and the cancelled one's bound: the next create's reservation would pass the budget.
            refused = create(c, messages=[{"role": "user", "content": big}], max_tokens=1)
            report = c.get("/v1/reports/usage").json()["total"]
    assert end.event == "cancelled"
    bound = prompt_token_bound(stored)
    assert end.data["usage"]["prompt_tokens"] == bound > prompt_tokens
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded", refused.text
    assert report["streams"] == 3 and report["prompt_tokens"] == 2 * prompt_tokens + bound
