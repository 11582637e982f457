"""rsb._types.Answer: what a stream's events add up to (text, reasoning, tool calls, the text as partial JSON),
``reset`` applied to all of it; alone, and read by the real client from a real `rsb consumer` over a real
Redis, across a resume that gets a reset."""

from __future__ import annotations

import copy
import json
from typing import Any

import redis
from servers import StackFactory
from typed_streams import StandInGenerator

from broker.redis.server import RedisServer
from rsb import Answer, Client, Event

ARGS: dict[str, Any] = {"city": "Zürich", "days": [1, 2, 3], "units": {"temp": "C", "wind": "km/h"}, "note": 'say "hi"\n'}


def _feed(answer: Answer, *events: tuple[str, str, Any]) -> None:
    for eid, etype, data in events:
        answer.feed(Event(eid, etype, data))


def test_reasoning_tool_calls_and_text_are_kept_apart_and_a_reset_takes_back_all_three() -> None:
    answer = Answer()
    _feed(answer, ("1-0", "started", {"model": "m"}), ("2-0", "reasoning", {"text": "Let me "}),
          ("3-0", "reasoning", {"text": "think."}), ("4-0", "delta", {"text": "Calling "}),
          ("5-0", "tool_call", {"index": 0, "id": "call_a", "name": "weather"}),
          ("6-0", "tool_args", {"index": 0, "text": '{"city": "Zü'}),
          ("7-0", "tool_call", {"index": 1, "id": "call_b", "name": "time"}),
          ("8-0", "tool_args", {"index": 1, "text": "{}"}),
          ("9-0", "tool_args", {"index": 0, "text": 'rich"}'}),
          ("10-0", "reasoning", {"text": " More."}))
    assert answer.reasoning == "Let me think. More." and answer.text == "Calling "
    assert [(c.index, c.id, c.name, c.arguments) for c in answer.tool_calls] == [
        (0, "call_a", "weather", '{"city": "Zürich"}'), (1, "call_b", "time", "{}")]
    assert answer.tool_calls[0].parsed_arguments == {"city": "Zürich"}
    # A failover lost 7-0 and after: the second call, the end of the first one's arguments, the reasoning.
    assert answer.feed(Event("6-0", "reset", {"last_event_id": "6-0"}))
    assert answer.reasoning == "Let me think." and answer.text == "Calling "
    assert [(c.index, c.name, c.arguments) for c in answer.tool_calls] == [(0, "weather", '{"city": "Zü')]
    assert answer.tool_calls[0].parsed_arguments == {"city": "Zü"}
    _feed(answer, ("11-0", "tool_args", {"index": 0, "text": 'g"}'}),
          ("12-0", "done", {"finish_reason": "tool_calls", "usage": {}}))
    assert answer.tool_calls[0].parsed_arguments == {"city": "Züg"} and answer.finish_reason == "tool_calls"
    assert not answer.feed(Event("12-0", "reset", {"last_event_id": "12-0"}))  # nothing after it: no change
    answer.feed(Event("0-0", "reset", {"last_event_id": None}))
    assert answer.text == answer.reasoning == "" and answer.tool_calls == []


def test_a_structured_answer_is_parsed_as_it_comes() -> None:
    answer = Answer()
    assert answer.parsed is None
    doc = json.dumps({"title": "Redis", "uses": ["cache", "queue", "streams"], "stars": 4.5})
    seen: list[Any] = []
    for i in range(0, len(doc), 7):
        answer.feed(Event(f"{i + 1}-0", "delta", {"text": doc[i:i + 7]}))
        seen.append(copy.deepcopy(answer.parsed))
    assert seen[:5] == [{}, {"title": "Red"}, {"title": "Redis"}, {"title": "Redis", "uses": []},
                        {"title": "Redis", "uses": ["cache"]}]
    answer.feed(Event("99-0", "done", {"finish_reason": "stop", "usage": {}}))
    assert answer.parsed == json.loads(doc)
    plain = Answer()
    plain.feed(Event("1-0", "delta", {"text": "Hello"}))
    try:
        plain.parsed  # noqa: B018
    except ValueError as e:
        assert "at character 0" in str(e)
    else:
        raise AssertionError("plain text parsed as JSON")


def test_the_client_reads_typed_output_and_applies_the_reset_of_a_resume(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The stream's events are written by the stand-in for the generator (tests/typed_streams.py) into the real
    Redis; a real `rsb consumer` serves them, the real client reads them. Mid-answer the reader stops; a failover
    loses the last events it had (XDEL); the stream goes on with other events; the reader resumes from its last
    id and gets a reset: its answer ends up exactly the stream's."""
    s = stack_factory(redis_server.url)
    s.consumer()
    args = json.dumps(ARGS)
    with Client(s.base_url) as client:
        sid = client.create(prompt="What is the weather?", max_tokens=64).id
        gen = StandInGenerator(redis_server.url, sid)
        gen.start()
        gen.append(("reasoning", {"text": "The user wants "}), ("reasoning", {"text": "the weather."}),
                   ("delta", {"text": "Let me check."}),
                   ("tool_call", {"index": 0, "id": "call_1", "name": "get_weather"}),
                   *[("tool_args", {"index": 0, "text": args[i:i + 5]}) for i in range(0, 40, 5)])
        answer = Answer()
        partial: list[Any] = []
        last = None
        for event in client.stream(sid):
            answer.feed(event)
            last = event.id
            if event.type == "tool_args":
                partial.append(copy.deepcopy(answer.tool_calls[0].parsed_arguments))
            if len(partial) == 8:
                break  # the reader leaves (a closed laptop) with 40 characters of the arguments
        assert answer.reasoning == "The user wants the weather." and answer.tool_calls[0].arguments == args[:40]
        lost = gen.ids()[-3:]
        assert lost[-1] == last
        gen.lose_tail(lost)  # the failover: the last three pieces of the arguments are gone
        gen.append(("tool_args", {"index": 0, "text": args[25:]}), ("delta", {"text": " Done."}))
        gen.finish("tool_calls", completion_tokens=12)

        events = list(client.stream(sid, last_event_id=last))
        assert events[0].type == "reset" and events[0].data == {"last_event_id": events[0].id}
        for event in events:
            answer.feed(event)
            if event.type == "tool_args":
                partial.append(copy.deepcopy(answer.tool_calls[0].parsed_arguments))
        whole = client.answer(sid)  # a fresh read of the stream as it now is
    assert answer.text == whole.text == "Let me check. Done."
    assert answer.reasoning == whole.reasoning == "The user wants the weather."
    call = answer.tool_calls[0]
    assert (call.index, call.id, call.name, call.arguments) == (0, "call_1", "get_weather", args)
    assert call.parsed_arguments == ARGS and answer.finish_reason == "tool_calls"
    assert [c.arguments for c in whole.tool_calls] == [args]
    # Every partial value agreed with the final one: the city grew to its whole name, and the days list only ever
    # held the final list's first days.
    assert partial[:4] == [{}, {"city": ""}, {"city": "Z"}, {"city": "Züric"}] and partial[-1] == ARGS
    for p in partial:
        assert ARGS["city"].startswith(p.get("city", "")) and ARGS["days"][:len(p.get("days", []))] == p.get("days", [])
