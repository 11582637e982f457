"""The generator's /metrics: jobs by outcome, tokens generated and wasted, TTFT/TPOT histograms."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis
from helpers import create, read_sse, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer, free_port

pytestmark = pytest.mark.slow


def _value(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_generator_metrics_count_what_was_generated_and_wasted(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    port = free_port()
    s.generator("--metrics-port", str(port), model=slow_model)
    with s.client() as c:
        done = create(c, max_tokens=30).json()["id"]
        wait_status(c, done, {"done"})
        long = create(c, max_tokens=3000).json()["id"]
        read_sse(c, f"/v1/streams/{long}/events", stop_after=10)
        c.post(f"/v1/streams/{long}/cancel")
        wasted = wait_status(c, long, {"cancelled"})["usage"]["completion_tokens"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'rsb_generator_jobs_total{status="done"} 1' in text
    assert 'rsb_generator_jobs_total{status="cancelled"} 1' in text
    assert _value(text, "rsb_generator_tokens_total") == 30 + wasted
    assert _value(text, "rsb_generator_tokens_wasted_total") == wasted
    assert _value(text, "rsb_generator_ttft_ms_count") == 2
    assert _value(text, "rsb_generator_running") == 0
    assert httpx.get(f"http://127.0.0.1:{port}/nope").status_code == 404
    # The GenAI conventions' histograms, under the names a collector's Prometheus exporter gives them (broker.genai):
    # the first token's time for the answer that succeeded, the duration of both (the cancel with its error.type).
    ttft = [line for line in text.splitlines() if line.startswith("gen_ai_server_time_to_first_token_seconds_count")]
    assert len(ttft) == 1 and 'gen_ai_operation_name="text_completion"' in ttft[0] and ttft[0].endswith(" 1.0")
    assert 'gen_ai_server_request_duration_seconds_count{' in text and 'error_type="cancelled"' in text
    output = [line for line in text.splitlines()
              if line.startswith("gen_ai_client_token_usage_sum") and 'gen_ai_token_type="output"' in line]
    assert len(output) == 1 and float(output[0].split()[-1]) == 30 + wasted
