"""schemathesis against /openapi.json on a real consumer: every route, many generated examples, no 5xx,
every response conforming to the spec."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import redis
import schemathesis
from conftest import StackFactory
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.schemas import OpenApiSchema

from broker.redis_server import RedisServer

if TYPE_CHECKING:
    # schemathesis.Case of an OpenAPI operation (an alias schemathesis defines for type checkers only).
    from schemathesis.specs.openapi.schemas import OpenApiCase


@pytest.fixture
def api_schema(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> OpenApiSchema:
    s = stack_factory(redis_server.url)
    s.consumer("--max-tokens-limit", "512", "--max-prompt-chars", "2000", "--max-messages", "16")
    s.generator()  # streams the fuzzer creates end quickly, so reading their events terminates
    return schemathesis.openapi.from_url(f"{s.base_url}/openapi.json")


# The native routes are fuzzed; the OpenAI-compatible views are described in the spec too, and tested
# with the official SDK in test_openai_compat.py (OpenAI's own schema, not ours, is their contract).
# The Durable Streams view (/v1/stream/{path}) is not in the spec: the protocol's own conformance suite is its
# contract (test_durable_conformance.py), and its behaviours are tested in test_durable_streams.py.
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path_regex="^/v1/(chat|responses|models|stream/)")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_conforms_and_never_fails(case: OpenApiCase) -> None:
    case.call_and_validate()
