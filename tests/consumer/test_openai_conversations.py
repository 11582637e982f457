"""OpenAI's Conversations API and ``conversation`` / ``previous_response_id`` on Responses, driven by the real
``openai`` SDK against a real stack (redis-server, `rsb generator`, `rsb consumer`): what the engine is sent for
each response is its request as stored (the history the server assembled, then the new input), checked
against what the conversation's items and the earlier responses say."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from conftest import Stack, StackFactory
from openai.types.responses import ResponseStreamEvent

from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow


def _client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


def _sid(response_id: str) -> uuid.UUID:
    return uuid.UUID(hex=response_id.removeprefix("resp_"))


def engine_messages(r: redis.Redis, response_id: str) -> list[dict[str, Any]]:
    """What the engine was sent for a response: its stored request's messages."""
    raw = r.hget(StreamKeys.of(_sid(response_id), 1).meta, "req")
    assert isinstance(raw, bytes)
    return list(orjson.loads(raw)["messages"])


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _items(client: openai.OpenAI, conv_id: str) -> list[dict[str, Any]]:
    return [i.model_dump(exclude_none=True) for i in client.conversations.items.list(conv_id, order="asc")]


def test_responses_in_a_conversation_get_its_history_plain_streamed_and_in_the_background(
        stack: Stack, redis_client: redis.Redis) -> None:
    client = _client(stack.base_url)
    conv = client.conversations.create(items=[{"type": "message", "role": "system", "content": "Be brief."}],
                                       metadata={"topic": "tests"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "tests"}

    # Plain (the create waits for the end).
    first = client.responses.create(model="m", conversation=conv.id, input="one", max_output_tokens=8)
    assert first.status == "incomplete" and first.conversation is not None and first.conversation.id == conv.id
    assert engine_messages(redis_client, first.id) == [{"role": "system", "content": "Be brief."}, user("one")]

    # Streamed, naming the conversation as an object.
    events = list(client.responses.create(model="m", conversation={"id": conv.id}, input="two",
                                          max_output_tokens=8, stream=True))
    second = events[-1].response  # type: ignore[union-attr]
    text2 = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert second.output_text == text2 and text2
    assert engine_messages(redis_client, second.id) == [
        {"role": "system", "content": "Be brief."}, user("one"), assistant(first.output_text), user("two")]

    # In the background, the connection dropped mid-answer, then resumed from the last sequence number.
    head: list[ResponseStreamEvent] = []
    with client.responses.create(model="m", conversation=conv.id, input="three", max_output_tokens=8,
                                 background=True, stream=True) as stream:
        for event in stream:
            head.append(event)
            if event.type == "response.output_text.delta":
                break
    rid = head[0].response.id  # type: ignore[union-attr]
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    third = rest[-1].response  # type: ignore[union-attr]
    assert [e.sequence_number for e in head + rest] == list(range(len(head) + len(rest)))
    assert third.conversation is not None and third.conversation.id == conv.id
    assert engine_messages(redis_client, third.id)[-3:] == [user("two"), assistant(text2), user("three")]

    # The conversation's items: each response's input, then its answer (the response's own output item).
    items = _items(client, conv.id)
    assert [(i["type"], i["role"], i["content"][0]["text"]) for i in items] == [
        ("message", "system", "Be brief."), ("message", "user", "one"), ("message", "assistant", first.output_text),
        ("message", "user", "two"), ("message", "assistant", text2), ("message", "user", "three"),
        ("message", "assistant", third.output_text)]
    assert items[2]["id"] == first.output[0].id and items[6]["id"] == third.output[0].id
    assert client.conversations.items.retrieve(items[1]["id"], conversation_id=conv.id).model_dump(
        exclude_none=True) == items[1]
    assert [i["id"] for i in (x.model_dump() for x in client.conversations.items.list(conv.id))] == [
        i["id"] for i in reversed(items)]  # desc by default, as OpenAI's

    # Metadata, then delete: the conversation is gone, and a response naming it is a 404.
    assert client.conversations.update(conv.id, metadata={"topic": "done"}).metadata == {"topic": "done"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "done"}
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    for call in (lambda: client.conversations.retrieve(conv.id), lambda: client.conversations.delete(conv.id),
                 lambda: client.responses.create(model="m", conversation=conv.id, input="x"),
                 lambda: list(client.conversations.items.list(conv.id))):
        with pytest.raises(openai.NotFoundError):
            call()


def test_a_response_while_another_of_its_conversation_runs_is_a_409(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    s.generator(model=slow_model)
    client = _client(s.base_url)
    conv = client.conversations.create()
    running = client.responses.create(model="m", conversation=conv.id, input="long", max_output_tokens=2000,
                                      background=True)
    with pytest.raises(openai.ConflictError) as e:
        client.responses.create(model="m", conversation=conv.id, input="meanwhile", background=True)
    assert e.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.ConflictError):
        client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    with pytest.raises(openai.ConflictError):  # its answer is not there yet
        client.responses.create(model="m", previous_response_id=running.id, input="next")
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    # Cancelled mid-answer: the partial answer is history; items can be added now.
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    assert [i.type for i in added.data] == ["message"]
    nxt = client.responses.create(model="m", conversation=conv.id, input="after", max_output_tokens=4)
    messages = engine_messages(redis_client, nxt.id)
    assert messages[0] == user("long") and messages[-2:] == [user("x"), user("after")]
    assert messages[1]["role"] == "assistant" and messages[1]["content"] == cancelled.output_text


def test_previous_response_id_chains_responses_without_their_instructions(
        stack: Stack, redis_client: redis.Redis) -> None:
    client = _client(stack.base_url)
    r1 = client.responses.create(model="m", input="a", instructions="Be terse.", max_output_tokens=6)
    assert engine_messages(redis_client, r1.id) == [{"role": "system", "content": "Be terse."}, user("a")]
    r2 = client.responses.create(model="m", previous_response_id=r1.id, input="b", max_output_tokens=6)
    assert r2.previous_response_id == r1.id and r2.conversation is None
    assert engine_messages(redis_client, r2.id) == [user("a"), assistant(r1.output_text), user("b")]
    events = list(client.responses.create(model="m", previous_response_id=r2.id, input="c", instructions="New.",
                                          max_output_tokens=6, stream=True))
    r3 = events[-1].response  # type: ignore[union-attr]
    assert engine_messages(redis_client, r3.id) == [
        {"role": "system", "content": "New."}, user("a"), assistant(r1.output_text), user("b"),
        assistant(r2.output_text), user("c")]
    assert client.responses.retrieve(r3.id).previous_response_id == r2.id
    conv = client.conversations.create()
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", conversation=conv.id, previous_response_id=r1.id, input="x")
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "previous_response_id"
    for rid in ("resp_" + uuid.uuid4().hex, "nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="m", previous_response_id=rid, input="x")
    for cid in ("conv_" + uuid.uuid4().hex, "nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="m", conversation=cid, input="x")


def test_items_are_listed_in_pages_as_openai_lists_them(stack: Stack) -> None:
    client = _client(stack.base_url)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": f"i{n}"}
                                              for n in range(5)])
    for n in range(3):
        client.responses.create(model="m", conversation=conv.id, input=f"q{n}", max_output_tokens=3)
    everything = _items(client, conv.id)
    assert len(everything) == 5 + 3 * 2
    ids = [i["id"] for i in everything]
    # The SDK's own pagination (``after`` = the last id of a page) walks every item once, in either order.
    assert [i.id for i in client.conversations.items.list(conv.id, limit=3, order="asc")] == ids
    assert [i.id for i in client.conversations.items.list(conv.id, limit=4, order="desc")] == ids[::-1]
    with httpx.Client(base_url=stack.base_url) as c:
        page = c.get(f"/v1/conversations/{conv.id}/items", params={"limit": 3, "order": "asc",
                                                                    "after": ids[2]}).json()
        assert [i["id"] for i in page["data"]] == ids[3:6]
        assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", ids[3], ids[5], True)
        last = c.get(f"/v1/conversations/{conv.id}/items", params={"limit": 100, "after": ids[1]}).json()
        assert [i["id"] for i in last["data"]] == ids[:1][::-1] and last["has_more"] is False
        for params in ({"after": "msg_nope"}, {"limit": 0}, {"limit": 101}, {"order": "up"}):
            r = c.get(f"/v1/conversations/{conv.id}/items", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(params)), params
        assert c.get(f"/v1/conversations/{conv.id}/items/msg_nope").status_code == 404
        bodies: list[dict[str, Any]] = [
            {"items": []}, {"items": [{"type": "message", "role": "nobody", "content": "x"}]}, {"metadata": {"k": 1}},
            {"metadata": {f"k{i}": "v" for i in range(17)}}, {"other": 1}]
        for body in bodies:
            r = c.post("/v1/conversations", json=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body


def test_tenants_see_only_their_own_conversations(stack_factory: StackFactory, redis_server: RedisServer,
                                                  redis_client: redis.Redis, tmp_path: Path) -> None:
    key_a, entry_a = new_key("alice")
    key_b, entry_b = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [entry_a, entry_b]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys))
    s.generator()
    alice, bob = _client(s.base_url, key_a), _client(s.base_url, key_b)
    conv = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "secret"}])
    r = alice.responses.create(model="m", conversation=conv.id, input="hi", max_output_tokens=3)
    for call in (lambda: bob.conversations.retrieve(conv.id), lambda: list(bob.conversations.items.list(conv.id)),
                 lambda: bob.conversations.delete(conv.id),
                 lambda: bob.responses.create(model="m", conversation=conv.id, input="x"),
                 lambda: bob.responses.create(model="m", previous_response_id=r.id, input="x")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert len(_items(alice, conv.id)) == 3
