"""OpenAI's Conversations API and ``conversation`` / ``previous_response_id`` on Responses, driven by the real
``openai`` SDK against a real stack: redis-server, `rsb consumer`, and `rsb generator --upstream` on a scripted
OpenAI-compatible server that records every request it gets (tests/scripted_upstream.py), so each test checks
the history the server assembled, as the engine received it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from helpers import eventually, wait_status
from openai.types.responses import ResponseStreamEvent
from scripted_upstream import Reply, ScriptedUpstream, args, call, reasoning, text
from servers import TEST_MODEL_NAMES, Stack, StackFactory

from broker.redis.server import RedisServer
from consumer.edge.auth import new_key

pytestmark = pytest.mark.slow

ANSWER = "Hello there!"  # the scripted upstream's default reply


class UpstreamStack:
    """A consumer and one generator whose engine is the scripted upstream."""

    def __init__(self, stack: Stack, upstream: ScriptedUpstream, *consumer_args: str) -> None:
        self.stack, self.up = stack, upstream
        stack.consumer("--heartbeat-s", "1", *consumer_args)
        gen = stack._run("generator", ["generator", "--redis-url", stack.redis_url, "--upstream", upstream.url,
                                       "--lease-s", "2", "--log-level", "info",
                                       "--model-alias", ",".join(TEST_MODEL_NAMES)])
        deadline = time.monotonic() + 30
        while "generator ready" not in gen.output():
            assert gen.alive() and time.monotonic() < deadline, gen.output()
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return str(self.stack.base_url)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def sent(self, n: int = -1) -> list[dict[str, Any]]:
        """The messages of the ``n``-th request the engine got (the last by default), as it got them."""
        return list(self.up.bodies()[n]["messages"])


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def rsb(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        upstream: ScriptedUpstream) -> UpstreamStack:
    return UpstreamStack(stack_factory(redis_server.url), upstream)


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def system(content: str) -> dict[str, Any]:
    return {"role": "system", "content": content}


def _items(client: openai.OpenAI, conv_id: str) -> list[dict[str, Any]]:
    return [i.model_dump(exclude_none=True) for i in client.conversations.items.list(conv_id, order="asc")]


def test_responses_in_a_conversation_get_its_history_plain_streamed_and_in_the_background(
        rsb: UpstreamStack) -> None:
    client = rsb.client()
    conv = client.conversations.create(items=[{"type": "message", "role": "system", "content": "Be brief."}],
                                       metadata={"topic": "tests"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "tests"}

    # Plain (the create waits for the end).
    rsb.up.script(Reply([text("One "), text("answer.")]))
    first = client.responses.create(model="m", conversation=conv.id, input="one")
    assert first.status == "completed" and first.output_text == "One answer."
    assert first.conversation is not None and first.conversation.id == conv.id
    assert rsb.sent() == [system("Be brief."), user("one")]

    # Streamed, naming the conversation as an object.
    events = list(client.responses.create(model="m", conversation={"id": conv.id}, input="two", stream=True))
    second = events[-1].response  # type: ignore[union-attr]
    assert second.output_text == ANSWER
    assert rsb.sent() == [system("Be brief."), user("one"), assistant("One answer."), user("two")]

    # In the background, the connection dropped mid-answer, then resumed from the last sequence number.
    rsb.up.script(Reply([text("Three, "), text("slowly "), text("told.")], delay_s=0.3))
    head: list[ResponseStreamEvent] = []
    with client.responses.create(model="m", conversation=conv.id, input="three", background=True,
                                 stream=True) as stream:
        for event in stream:
            head.append(event)
            if event.type == "response.output_text.delta":
                break
    rid = head[0].response.id  # type: ignore[union-attr]
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    third = rest[-1].response  # type: ignore[union-attr]
    assert [e.sequence_number for e in head + rest] == list(range(len(head) + len(rest)))
    assert third.output_text == "Three, slowly told."
    assert third.conversation is not None and third.conversation.id == conv.id
    assert rsb.sent()[-3:] == [user("two"), assistant(ANSWER), user("three")]

    # The conversation's items: each response's input, then its answer (the response's own output item).
    items = _items(client, conv.id)
    assert [(i["type"], i["role"], i["content"][0]["text"]) for i in items] == [
        ("message", "system", "Be brief."), ("message", "user", "one"), ("message", "assistant", "One answer."),
        ("message", "user", "two"), ("message", "assistant", ANSWER), ("message", "user", "three"),
        ("message", "assistant", "Three, slowly told.")]
    assert items[2]["id"] == first.output[0].id and items[6]["id"] == third.output[0].id
    assert client.conversations.items.retrieve(items[1]["id"], conversation_id=conv.id).model_dump(
        exclude_none=True) == items[1]
    assert [i.id for i in client.conversations.items.list(conv.id)] == [i["id"] for i in reversed(items)]

    # The next response is built on all of it.
    client.responses.create(model="m", conversation=conv.id, input="four")
    assert rsb.sent() == [system("Be brief."), user("one"), assistant("One answer."), user("two"),
                          assistant(ANSWER), user("three"), assistant("Three, slowly told."), user("four")]

    # Metadata, then delete: the conversation is gone, and a response naming it is a 404.
    assert client.conversations.update(conv.id, metadata={"topic": "done"}).metadata == {"topic": "done"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "done"}
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    for call_ in (lambda: client.conversations.retrieve(conv.id), lambda: client.conversations.delete(conv.id),
                  lambda: client.responses.create(model="m", conversation=conv.id, input="x"),
                  lambda: list(client.conversations.items.list(conv.id))):
        with pytest.raises(openai.NotFoundError):
            call_()


def test_a_response_while_another_of_its_conversation_runs_is_a_409(rsb: UpstreamStack) -> None:
    client = rsb.client()
    conv = client.conversations.create()
    rsb.up.script(Reply([text("Still "), text("going")], hold=True))  # runs until it is cancelled
    running = client.responses.create(model="m", conversation=conv.id, input="long", background=True)
    rsb.up.wait_requests(1)
    with pytest.raises(openai.ConflictError) as e:
        client.responses.create(model="m", conversation=conv.id, input="meanwhile", background=True)
    assert e.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.ConflictError):
        client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    with pytest.raises(openai.ConflictError):  # its answer is not there yet
        client.responses.create(model="m", previous_response_id=running.id, input="next")
    assert len(rsb.up.requests) == 1  # none of them reached the engine
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.output_text == "Still going"
    # Cancelled mid-answer: the partial answer is history; items can be added now.
    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    assert [i.type for i in added.data] == ["message"]
    client.responses.create(model="m", conversation=conv.id, input="after")
    assert rsb.sent() == [user("long"), assistant("Still going"), user("x"), user("after")]


def test_previous_response_id_chains_responses_without_their_instructions(rsb: UpstreamStack) -> None:
    client = rsb.client()
    r1 = client.responses.create(model="m", input="a", instructions="Be terse.")
    assert rsb.sent() == [system("Be terse."), user("a")]
    rsb.up.script(Reply([text("B.")]))
    r2 = client.responses.create(model="m", previous_response_id=r1.id, input="b")
    assert r2.previous_response_id == r1.id and r2.conversation is None
    assert rsb.sent() == [user("a"), assistant(ANSWER), user("b")]
    events = list(client.responses.create(model="m", previous_response_id=r2.id, input="c", instructions="New.",
                                          stream=True))
    r3 = events[-1].response  # type: ignore[union-attr]
    assert rsb.sent() == [system("New."), user("a"), assistant(ANSWER), user("b"), assistant("B."), user("c")]
    assert client.responses.retrieve(r3.id).previous_response_id == r2.id
    # A background continuation, read when it has ended.
    r4 = client.responses.create(model="m", previous_response_id=r3.id, input="d", background=True)
    rest = list(client.responses.retrieve(r4.id, stream=True))
    assert rest[-1].type == "response.completed"
    assert rsb.sent()[-3:] == [user("c"), assistant(ANSWER), user("d")]
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


def test_a_conversation_keeps_tool_calls_and_their_results(rsb: UpstreamStack) -> None:
    """A turn that ends in tool calls: its calls are history, the next turn sends the results."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    conv = str(uuid.uuid4())
    rsb.up.script(Reply([text("Let me look."), call(0, "call_1", "get_weather"), args(0, '{"city": '),
                         args(0, '"Paris"}')], finish_reason="tool_calls"))
    with httpx.Client(base_url=rsb.url, timeout=30) as c:
        r = c.post("/v1/streams", json={"conversation": conv, "tools": tools,
                                        "messages": [user("Weather in Paris?")]})
        assert r.status_code == 201, r.text

        def first_turn_done() -> list[dict[str, Any]] | None:
            turns = c.get(f"/v1/conversations/{conv}/turns").json()["turns"]
            return turns if turns[0]["status"] == "done" else None

        turns = eventually(first_turn_done, 30, "the first turn done")
        call_json = {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        assert turns[0]["output"]["tool_calls"] == [call_json] and turns[0]["finish_reason"] == "tool_calls"
        r = c.post("/v1/streams", json={"conversation": conv, "tools": tools, "messages": [
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]})
        assert r.status_code == 201, r.text
        second = r.json()["id"]
        rsb.up.wait_requests(2)
        wait_status(c, second, {"done"}, 30)
    assert rsb.sent() == [user("Weather in Paris?"),
                          {"role": "assistant", "content": "Let me look.", "tool_calls": [call_json]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    items = _items(rsb.client(), f"conv_{uuid.UUID(conv).hex}")
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output", "message"]
    assert (items[2]["call_id"], items[2]["name"], items[2]["arguments"]) == ("call_1", "get_weather",
                                                                              '{"city": "Paris"}')
    assert (items[3]["call_id"], items[3]["output"]) == ("call_1", "sunny, 24 C")
    assert items[4]["content"][0]["text"] == ANSWER


def test_every_item_of_a_conversation_has_its_own_id_and_can_be_referenced(rsb: UpstreamStack) -> None:
    """Issue 45: a turn with two input messages and an answer of [reasoning, message] listed ``msg_<hex>_1`` twice
    (the answer could not be fetched by its id), and an input call's ``fc_<hex>_<i>_<j>`` was refused as an
    item_reference. Input and output ids are apart now; a conversation's input items are referenced in its responses."""
    client = rsb.client()
    conv = client.conversations.create(items=[
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    rsb.up.script(Reply([reasoning("It is sunny."), text("Sunny, ")]))
    answer = client.responses.create(model="m", conversation=conv.id, input=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "And tomorrow?"}])
    items = _items(client, conv.id)
    ids = [i["id"] for i in items]
    assert len(set(ids)) == len(ids) == 7, ids
    assert ids[-2:] == [o.id for o in answer.output] and [i["type"] for i in items[-2:]] == ["reasoning", "message"]
    got = client.conversations.items.retrieve(ids[-1], conversation_id=conv.id)
    assert got.model_dump(exclude_none=True) == items[-1]  # the answer, not the turn's second input message
    # Referenced in a response of the conversation: the input call and its result, and the input message (not the
    # answer that once shared its id).
    refs = [{"type": "item_reference", "id": i} for i in (ids[1], ids[2], ids[4])]
    client.responses.create(model="m", conversation=conv.id, input=refs)  # type: ignore[arg-type]
    call_json = {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert rsb.sent()[-3:] == [{"role": "assistant", "content": None, "tool_calls": [call_json]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, user("And tomorrow?")]
    with pytest.raises(openai.BadRequestError) as e:  # outside the conversation, its input items name nothing
        client.responses.create(model="m", input=refs)  # type: ignore[arg-type]
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "input" and "conversation" in e.value.body["message"]


def test_items_are_listed_in_pages_as_openai_lists_them(rsb: UpstreamStack) -> None:
    client = rsb.client()
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": f"i{n}"}
                                              for n in range(5)])
    for n in range(3):
        client.responses.create(model="m", conversation=conv.id, input=f"q{n}")
    everything = _items(client, conv.id)
    assert len(everything) == 5 + 3 * 2
    ids = [i["id"] for i in everything]
    # The SDK's own pagination (``after`` = the last id of a page) walks every item once, in either order.
    assert [i.id for i in client.conversations.items.list(conv.id, limit=3, order="asc")] == ids
    assert [i.id for i in client.conversations.items.list(conv.id, limit=4, order="desc")] == ids[::-1]
    with httpx.Client(base_url=rsb.url) as c:
        page = c.get(f"/v1/conversations/{conv.id}/items", params={"limit": 3, "order": "asc",
                                                                    "after": ids[2]}).json()
        assert [i["id"] for i in page["data"]] == ids[3:6]
        assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", ids[3], ids[5], True)
        last = c.get(f"/v1/conversations/{conv.id}/items", params={"limit": 100, "after": ids[1]}).json()
        assert [i["id"] for i in last["data"]] == ids[:1] and last["has_more"] is False
        for params in ({"limit": 0}, {"limit": 101}, {"order": "up"}):
            r = c.get(f"/v1/conversations/{conv.id}/items", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(params)), params
        assert c.get(f"/v1/conversations/{conv.id}/items", params={"after": "msg_nope"}).status_code == 404
        assert c.get(f"/v1/conversations/{conv.id}/items/msg_nope").status_code == 404
        bodies: list[dict[str, Any]] = [
            {"items": []}, {"items": [{"type": "message", "role": "nobody", "content": "x"}]}, {"metadata": {"k": 1}},
            {"metadata": {f"k{i}": "v" for i in range(17)}}, {"other": 1}]
        for body in bodies:
            r = c.post("/v1/conversations", json=body)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body


def test_tenants_see_only_their_own_conversations(stack_factory: StackFactory, redis_server: RedisServer,
                                                  redis_client: redis.Redis, upstream: ScriptedUpstream,
                                                  tmp_path: Path) -> None:
    key_a, entry_a = new_key("alice")
    key_b, entry_b = new_key("bob")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [entry_a, entry_b]}))
    rsb = UpstreamStack(stack_factory(redis_server.url), upstream, "--api-keys", str(keys))
    alice, bob = rsb.client(key_a), rsb.client(key_b)
    conv = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "secret"}])
    r = alice.responses.create(model="m", conversation=conv.id, input="hi")
    for call_ in (lambda: bob.conversations.retrieve(conv.id), lambda: list(bob.conversations.items.list(conv.id)),
                  lambda: bob.conversations.delete(conv.id),
                  lambda: bob.responses.create(model="m", conversation=conv.id, input="x"),
                  lambda: bob.responses.create(model="m", previous_response_id=r.id, input="x")):
        with pytest.raises(openai.NotFoundError):
            call_()
    assert len(_items(alice, conv.id)) == 3
    assert len(upstream.requests) == 1


def test_the_upstream_gets_a_prompt_cache_key_stable_over_a_conversation(rsb: UpstreamStack) -> None:
    """OpenAI routes requests sharing a prompt_cache_key to the machine holding their prefix: a client's own key
    is passed on as a digest within the tenant (two tenants naming one key share nothing through it: issue 31);
    a conversation's turns (and a chat's, by its leading messages) share one of rsb's."""
    client = rsb.client()
    client.responses.create(model="m", input="hi", prompt_cache_key="my-key")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], prompt_cache_key="other-key")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "bye"}], prompt_cache_key="my-key")
    own = [b["prompt_cache_key"] for b in rsb.up.bodies()]
    assert own[0] == own[2] != own[1] and all(k.startswith("rsb-") and "key" not in k for k in own)
    conv = client.conversations.create()
    for text_ in ("one", "two"):
        client.responses.create(model="m", conversation=conv.id, input=text_)
    other = client.conversations.create()
    client.responses.create(model="m", conversation=other.id, input="one")
    keys = [b["prompt_cache_key"] for b in rsb.up.bodies()[3:]]
    assert keys[0] == keys[1] != keys[2] and keys[0].startswith("rsb-")
    assert "one" not in keys[0] and conv.id not in keys[0]
