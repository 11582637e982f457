"""Agent frameworks unchanged against a running rsb, through their own code paths (pinned in the test extra):
openai-agents (Responses, with server-side state: ``auto_previous_response_id`` and ``conversation_id``, and chat
completions), langchain-openai (``bind_tools``, ``with_structured_output(method="function_calling")``, which
sends ``parallel_tool_calls: false``), pydantic-ai (its output tool). A scripted upstream gives the exact tool
loops; the default model gives structured output with numeric bounds and formats, checked against the schema.
(instructor 1.17 pins ``jiter<0.15``, which the openai SDK the suite runs cannot take: not installed.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
from pydantic import BaseModel, Field
from scripted_upstream import Reply, ScriptedUpstream, text, tool_call_pieces
from servers import Stack, StackFactory

from broker.redis.server import RedisServer

agents = pytest.importorskip("agents", reason="the test extra installs openai-agents")
langchain_openai = pytest.importorskip("langchain_openai", reason="the test extra installs langchain-openai")
pytest.importorskip("pydantic_ai", reason="the test extra installs pydantic-ai-slim[openai]")

import openai  # noqa: E402
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from pydantic_ai import Agent as PydanticAgent  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

ARGS = '{"city": "Paris"}'
pytestmark = pytest.mark.slow


def weather_call(call_id: str) -> Reply:
    return Reply(tool_call_pieces(0, call_id, "get_weather", ARGS), finish_reason="tool_calls")


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def scripted(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
             upstream: ScriptedUpstream) -> Stack:
    s = stack_factory(redis_server.url)
    s.generator("--upstream", upstream.url, ignore_eos=False)
    s.consumer()
    return s


def _async_client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _weather_agent(model: Any) -> Any:
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"18 C in {city}"

    tool = agents.function_tool(get_weather)
    return agents.Agent(name="weather", instructions="Answer with the weather.", tools=[tool], model=model)


@pytest.mark.parametrize("state", ["input", "auto_previous_response_id", "conversation_id"])
def test_openai_agents_runs_its_tool_loop_on_the_responses_api(scripted: Stack, upstream: ScriptedUpstream,
                                                               state: str) -> None:
    agents.set_tracing_disabled(True)
    client = _async_client(scripted)
    upstream.script(weather_call("call_a1"), Reply([text("It is 18 C in Paris.")]))

    async def run() -> Any:
        agent = _weather_agent(agents.OpenAIResponsesModel("scripted-model", client))
        kwargs: dict[str, Any] = {}
        if state == "auto_previous_response_id":
            kwargs["auto_previous_response_id"] = True
        elif state == "conversation_id":
            kwargs["conversation_id"] = (await client.conversations.create()).id
        return await agents.Runner.run(agent, "Weather in Paris?", **kwargs)

    result = asyncio.run(run())
    assert result.final_output == "It is 18 C in Paris."
    second = upstream.bodies()[1]["messages"]
    assert [m["role"] for m in second][-2:] == ["assistant", "tool"]  # the call, then its output: one history
    assert second[-1]["content"] == "18 C in Paris" and second[-2]["tool_calls"][0]["id"] == "call_a1"


def test_openai_agents_on_chat_completions(scripted: Stack, upstream: ScriptedUpstream) -> None:
    agents.set_tracing_disabled(True)
    upstream.script(weather_call("call_c1"), Reply([text("Sunny.")]))
    agent = _weather_agent(agents.OpenAIChatCompletionsModel("scripted-model", _async_client(scripted)))
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?"))
    assert result.final_output == "Sunny."


class City(BaseModel):
    """A city the user asked about."""

    city: str
    population: int = Field(ge=0)


def test_langchain_tools_and_structured_output_by_function_calling(scripted: Stack,
                                                                   upstream: ScriptedUpstream) -> None:
    chat = langchain_openai.ChatOpenAI(model="scripted-model", base_url=f"{scripted.base_url}/v1", api_key="unused",
                                       max_retries=0)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "18 C"

    upstream.script(weather_call("call_l1"), Reply([text("18 C.")]))
    bound = chat.bind_tools([get_weather])
    ai = bound.invoke([HumanMessage("Weather in Paris?")])
    assert ai.tool_calls[0]["name"] == "get_weather" and ai.tool_calls[0]["args"] == {"city": "Paris"}
    done = bound.invoke([HumanMessage("Weather in Paris?"), ai, ToolMessage("18 C", tool_call_id="call_l1")])
    assert done.content == "18 C."

    upstream.script(Reply(tool_call_pieces(0, "call_l2", "City", '{"city": "Oslo", "population": 709000}'),
                          finish_reason="tool_calls"))
    city = chat.with_structured_output(City, method="function_calling").invoke("Tell me about Oslo.")
    assert city == City(city="Oslo", population=709000)
    sent = upstream.bodies()[-1]
    assert sent["parallel_tool_calls"] is False  # what LangChain sends; rsb passes it on
    assert sent["tools"][0]["function"]["parameters"]["properties"]["population"]["minimum"] == 0


def test_pydantic_ai_output_tool(scripted: Stack, upstream: ScriptedUpstream) -> None:
    upstream.script(Reply(tool_call_pieces(0, "call_p1", "final_result", '{"city": "Rome", "population": 2800000}'),
                          finish_reason="tool_calls"))
    model = OpenAIChatModel("scripted-model", provider=OpenAIProvider(base_url=f"{scripted.base_url}/v1",
                                                                     api_key="unused"))
    out = PydanticAgent(model, output_type=City).run_sync("Tell me about Rome.").output
    assert out == City(city="Rome", population=2800000)


# -- the default model: structured output with bounds and formats, enforced by constrained decoding ---------------


class Event(BaseModel):
    """An event on a calendar."""

    title: str = Field(max_length=40)
    day: str = Field(json_schema_extra={"format": "date"})
    attendees: int = Field(ge=1, le=500)
    score: float = Field(ge=0, le=1)


@pytest.fixture(scope="module")
def model_stack(tmp_path_factory: pytest.TempPathFactory, default_gguf: Path) -> Iterator[Stack]:
    server = RedisServer().start()
    s = Stack(server.url, default_gguf, tmp_path_factory.mktemp("stack"))
    try:
        s.generator(ignore_eos=False)
        s.consumer()
        yield s
    finally:
        s.close()
        server.cleanup()


@pytest.mark.timeout(900)
def test_structured_output_with_bounds_and_formats_from_the_default_model(model_stack: Stack) -> None:
    schema = Event.model_json_schema()
    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=f"{model_stack.base_url}/v1", api_key="unused"))
    out = PydanticAgent(model, output_type=Event).run_sync("Plan a team lunch next Friday.").output
    jsonschema.validate(out.model_dump(mode="json"), schema,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    sync = openai.OpenAI(base_url=f"{model_stack.base_url}/v1", api_key="unused", max_retries=0)
    parsed = sync.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Plan a lunch."}],
                                         response_format=Event, max_tokens=200)
    event = parsed.choices[0].message.parsed
    assert event is not None
    jsonschema.validate(json.loads(parsed.choices[0].message.content or ""), schema,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
