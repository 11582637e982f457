"""--drop-unsupported-params and a key's ``drop_unsupported_params``: a parameter the model cannot honour (what an
agent sends by default: ``reasoning_effort``, ``verbosity``, Responses' ``reasoning`` and ``text.verbosity``) is
dropped instead of a 400, and the response says so in ``X-Rsb-Dropped-Params``; strict by default; a typo or a
parameter that changes what comes back (``n``) stays a 400 whatever the setting. Driven by the real ``openai`` SDK
against real redis-server, `rsb generator` and `rsb consumer` processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from servers import StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

CHAT: list[Any] = [{"role": "user", "content": "Hi"}]
HEADER = "x-rsb-dropped-params"


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_unsupported_parameters_are_dropped_when_asked_and_named_in_a_header(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    keys: dict[str, str] = {}
    entries = []
    for name, drop in (("strict", None), ("lenient", True), ("pinned", False)):
        keys[name], entry = new_key(name)
        entries.append(entry if drop is None else {**entry, "drop_unsupported_params": drop})
    keys_file = tmp_path / "keys.json"
    keys_file.write_bytes(orjson.dumps({"keys": entries}))
    s = stack_factory(redis_server.url)
    s.generator()
    _, strict_pod = s.consumer("--api-keys", str(keys_file))
    _, lenient_pod = s.consumer("--api-keys", str(keys_file), "--drop-unsupported-params")
    agent_defaults: dict[str, Any] = {"reasoning_effort": "low", "verbosity": "medium"}

    # Strict by default: the pod without the flag refuses them for a key that does not say otherwise.
    with pytest.raises(openai.BadRequestError) as e:
        _client(strict_pod, keys["strict"]).chat.completions.create(model="m", messages=CHAT, max_tokens=4,
                                                                    **agent_defaults)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "reasoning_effort"
    # A key that drops them, on that pod; any key but the one pinned to strict, on the pod with the flag.
    for url, who in ((strict_pod, "lenient"), (lenient_pod, "strict"), (lenient_pod, "lenient")):
        client = _client(url, keys[who])
        raw = client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=4,
                                                               **agent_defaults)
        assert raw.headers[HEADER] == "reasoning_effort,verbosity", (url, who)
        assert raw.parse().choices[0].finish_reason == "length"
        streamed = client.chat.completions.with_raw_response.create(
            model="m", messages=CHAT, max_tokens=4, stream=True, reasoning_effort="high")
        assert streamed.headers[HEADER] == "reasoning_effort"
        assert [c for c in streamed.parse()][-1].choices[0].finish_reason == "length"
        # Nothing to drop: no header.
        plain = client.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=4)
        assert HEADER not in plain.headers
        response = client.responses.with_raw_response.create(
            model="m", input="Hi", max_output_tokens=4, reasoning={"effort": "low"},
            text={"verbosity": "low", "format": {"type": "text"}})
        assert response.headers[HEADER] == "reasoning,text.verbosity"
        assert response.parse().status == "incomplete"
        # What is no model's to honour but changes what comes back, and what nobody knows, stay refused.
        for bad, param in (({"n": 2}, "n"), ({"extra_body": {"reasoning_efort": "low"}}, "reasoning_efort")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, **bad)
            assert isinstance(e.value.body, dict) and e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        _client(lenient_pod, keys["pinned"]).chat.completions.create(model="m", messages=CHAT, max_tokens=4,
                                                                     **agent_defaults)
