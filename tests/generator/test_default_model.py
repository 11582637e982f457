"""The real default model end to end over the SSE API: SmolLM2-135M-Instruct in a real `rsb generator`,
read through a real `rsb consumer`. The answer is English, every surface names the model honestly, the
prompt is the model's own ChatML template applied to the whole conversation, and a seed repeats an answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from helpers import assert_english, create, eventually, read_sse
from servers import StackFactory

from broker.redis.server import RedisServer
from generator.engines.default_model import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is a resumable stream?"},
]
# SmolLM2's template (tests/data/chat_templates/chatml-smollm2.jinja) applied to CONVERSATION, by hand.
CHATML = ("<|im_start|>system\nYou are a concise assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
          "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"
          "<|im_start|>user\nWhat is a resumable stream?<|im_end|>\n<|im_start|>assistant\n")


def test_the_default_model_answers_a_conversation_in_english_under_its_own_name(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, default_gguf: Path) -> None:
    import llama_cpp

    s = stack_factory(redis_server.url)
    s.generator(model=default_gguf, ignore_eos=False)
    s.consumer()
    vocab = llama_cpp.Llama(model_path=str(default_gguf), vocab_only=True, verbose=False)
    prompt_tokens = len(vocab.tokenize(CHATML.encode(), add_bos=False, special=True))
    vocab.close()
    with s.client() as c:
        # The models themselves (the test generators also answer to the tests' aliases, listed with their root).
        models = eventually(lambda: [m["id"] for m in c.get("/v1/models").json()["data"] if m["root"] == m["id"]], 30,
                            "the generator announcing its model")
        assert models == [DEFAULT_MODEL_NAME]
        body = {"messages": CONVERSATION, "max_tokens": 64, "temperature": 0.2, "seed": 7}
        first = create(c, body)
        assert first.status_code == 201
        read = read_sse(c, first.json()["events_url"], timeout_s=120)
        kinds = [e.event for e in read.events]
        assert kinds[:2] == ["queued", "started"] and kinds[-1] == "done" and set(kinds[2:-1]) == {"delta"}
        assert read.events[1].data == {"model": DEFAULT_MODEL_NAME, "service_tier": "default"}
        usage = read.events[-1].data["usage"]
        assert usage["prompt_tokens"] == prompt_tokens  # exactly the template's prompt: no extra BOS, no drift
        assert_english(read.text)
        assert "stream" in read.text.lower()
        assert c.get(f"/v1/streams/{first.json()['id']}").json()["model"] == DEFAULT_MODEL_NAME
        # The same request and seed under another id: the same answer, token for token.
        again = read_sse(c, create(c, body).json()["events_url"], timeout_s=120)
        assert again.text == read.text
