"""schemathesis with every check, over every route of /openapi.json (the OpenAI views included, each SSE
event validated), against a real consumer and generator: no 5xx, every response conforming to the document,
every request the document allows accepted and every one it forbids refused. It runs schemathesis' own
command line, as a user would, with a fixed seed so a failure reproduces.

Not in the document, so not fuzzed here: the AI SDK view (/api/chat...), whose contract is the `ai`
package's transport and UI message stream, driven with the real client (ai@5 and ai@6) in test_aisdk.py; the
Durable Streams view (/v1/stream/{path}), whose contract is the protocol's own conformance suite
(test_durable_conformance.py), its behaviours tested in test_durable_streams.py; and Anthropic's Messages view
(/v1/messages...), whose contract is Anthropic's API, driven with its own SDKs and the frameworks that speak it in
test_anthropic.py and test_anthropic_js.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from servers import StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

# A run takes ~45 s on a quiet machine and passed the suite's 120 s once beside `bench latency` (load 5-8): the
# fixed work of schemathesis's examples, slowed down; its subprocess's own 600 s bound is what catches a hang.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

# The limits the consumer runs with: small, so the generated bodies reach them; and a short default answer, so
# that the generations the fuzzer starts (most name no max_tokens) queue for little time behind each other.
# The fuzzer sends mostly invalid requests, on purpose, from one address: the refusal budget would rightly make
# them 429 too_many_refusals (tests/consumer/test_hostile_clients.py tests it), so it is off here.
LIMITS = ("--max-tokens-limit", "512", "--max-prompt-chars", "2000", "--max-messages", "16",
          "--default-max-tokens", "32", "--refusal-burst", "0")
SEED = "20261130"


def _schemathesis(base_url: str, tmp_path: Path, *extra: str, max_examples: int) -> subprocess.CompletedProcess[str]:
    cli = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    report = tmp_path / "junit.xml"
    # A body past --max-body-bytes is refused with a 413 before it is read: a rejection like a 400 (schemathesis
    # counts only its default statuses as rejections, and may make a too long string a megabyte long).
    config = tmp_path / "schemathesis.toml"
    config.write_text('[checks.negative_data_rejection]\nexpected-statuses = ["400", "401", "403", "404", "405", '
                      '"406", "409", "413", "415", "422", "428", "429", "5XX"]\n')
    return subprocess.run(
        [cli, "--no-color", "--config-file", str(config), "run", f"{base_url}/openapi.json", "--checks", "all", "--phases", "coverage,fuzzing,stateful",
         "--max-examples", str(max_examples), "--seed", SEED, "--request-timeout", "30",
         "--report", "junit", "--report-junit-path", str(report), *extra],
        capture_output=True, text=True, timeout=600)


def _assert_clean(r: subprocess.CompletedProcess[str]) -> None:
    summary = r.stdout[r.stdout.rfind("SUMMARY"):] if "SUMMARY" in r.stdout else r.stdout[-3000:]
    assert r.returncode == 0, r.stdout[-12000:] + r.stderr[-3000:]
    assert "passed" in summary and "failed" not in summary.lower().replace("0 failed", ""), summary


def test_every_route_conforms_with_every_check(stack_factory: StackFactory, redis_server: RedisServer,
                                               redis_client: redis.Redis, tmp_path: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer(*LIMITS)
    s.generator()  # streams the fuzzer creates end quickly, so reading their events terminates
    spec = s.client().get("/openapi.json").json()
    # Every route of the app is in the document (a route missing there is a route never fuzzed).
    assert {"/v1/streams", "/v1/chat/completions", "/v1/responses", "/v1/models/{model}", "/metrics"} <= set(
        spec["paths"])
    _assert_clean(_schemathesis(s.base_url, tmp_path, max_examples=60))


def test_with_api_keys_every_route_conforms_and_refuses_the_unauthenticated(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    token, entry = new_key("fuzzer")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [entry]}))
    s = stack_factory(redis_server.url)
    s.consumer(*LIMITS, "--api-keys", str(keys))
    s.generator()
    # ignored_auth (one of the checks) also calls each operation without credentials and expects 401.
    _assert_clean(_schemathesis(s.base_url, tmp_path, "--header", f"Authorization: Bearer {token}",
                                max_examples=20))


@pytest.mark.parametrize(("path", "param", "value"), [("/v1/chat/completions", "functions", [{"name": "f"}]),
                                                   ("/v1/responses", "truncation", "auto")])
def test_the_document_lists_what_the_openai_views_refuse(stack_factory: StackFactory, redis_server: RedisServer,
                                                         redis_client: redis.Redis, path: str, param: str,
                                                         value: object) -> None:
    """The rules behind the views are the document's: a parameter rsb cannot honour is described as refused,
    and refused with 400 naming it. Typed output's fields are described in words (their acceptance depends on
    more than JSON Schema says: consumer/views/openai/schema.py), so the fuzzer leaves them alone."""
    s = stack_factory(redis_server.url)
    s.consumer(*LIMITS)
    schema = s.client().get("/openapi.json").json()["paths"][path]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    props = schema["properties"]
    refused = {"functions": {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]},
               "truncation": {"anyOf": [{"const": "disabled"}, {"type": "null"}]}}
    assert props[param] == refused[param]
    assert "tools" not in props and "`tools`" in schema["description"] and "`tool_choice`" in schema["description"]
    body = ({"messages": [{"role": "user", "content": "hi"}]} if path.endswith("completions") else {"input": "hi"})
    with s.client() as c:
        r = c.post(path, json={**body, param: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
