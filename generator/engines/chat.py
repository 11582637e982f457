"""Chat templates: ``messages`` to the prompt text a model was trained on, rendered with the model's own
template (GGUF ``tokenizer.chat_template``) exactly as transformers and llama-cpp-python render it
(``Jinja2ChatFormatter``: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``).

Kept apart from the engine so that a template can be checked against hand-written prompts without a model
(tests/generator/test_chat_templates.py, one test per template family). What rsb adds to the template:
- a template that refuses the ``system`` role (Gemma's "System role not supported") gets the system prompt
  folded into the first user turn, separated by a blank line, as llama.cpp's own chat code does;
- any other refusal (roles that do not alternate, an unsupported role) is an ``invalid_request`` error
  event carrying the template's own message, not an engine crash;
- tools (``render_chat``): a template that renders tools itself (it uses ``tools`` and ``tool_calls``, as
  Qwen's, Llama 3.1+'s and Mistral's do) gets them, the assistant calls (arguments as objects, as
  transformers passes them) and the ``tool`` messages as they are; any other template gets the Hermes
  convention written into the conversation: the tools described in the system prompt (Qwen 2.5's own wording),
  each call as ``<tool_call>`` JSON in the assistant's text, each result as a user turn in ``<tool_response>``
  (consecutive results in one turn), which is what the engine then parses (generator.engines.tool_syntax).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from broker.request.generation import Message as RequestMessage
from broker.request.generation import Tool
from generator.engines.base import EngineError
from generator.engines.tool_syntax import closed_call_text

#: Used when a GGUF carries no chat template: the plain role-tagged format of the demo model.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

Message = Mapping[str, Any]

# Qwen 2.5's template's words for tools, for templates that have none of their own.
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


class ChatTemplateError(EngineError):
    """The model's chat template refuses this conversation (its message says why)."""

    code = "invalid_request"


def fold_system(messages: Sequence[Message]) -> list[dict[str, str]]:
    """The conversation without system messages: their text leads the first user turn (or becomes one)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if not system:
        return rest
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            return rest
    return [{"role": "user", "content": system}, *rest]


class ChatTemplate:
    """One model's chat template with its BOS and EOS token texts (the ``bos_token``/``eos_token`` the
    template writes). ``render`` returns the prompt text, special tokens spelled as text."""

    def __init__(self, template: str | None, *, bos_token: str, eos_token: str) -> None:
        self.template = template or FALLBACK_CHAT_TEMPLATE
        self._formatter = Jinja2ChatFormatter(template=self.template, eos_token=eos_token, bos_token=bos_token,
                                              add_generation_prompt=True)

    def _render(self, messages: Sequence[Message], extra: Mapping[str, Any]) -> str:
        # llama_cpp types messages as its own TypedDict union; plain role/content dicts are what it renders.
        prompt: str = self._formatter(messages=list(messages), **extra).prompt  # type: ignore[arg-type]
        return prompt

    @property
    def renders_tools(self) -> bool:
        """The template writes tools, calls and their results itself."""
        return "tools" in self.template and "tool_calls" in self.template

    def render_chat(self, messages: Sequence[RequestMessage], tools: Sequence[Tool] = (),
                    text: Callable[[Any], Any] | None = None, **extra: Any) -> str:
        """A request's messages (and the tools the model may call) as the prompt text. ``text``: applied to the
        messages and tools as the template will see them, every string of which is the client's
        (generator.engines.control_tokens shields them)."""
        def client(value: Any) -> Any:
            return value if text is None else text(value)

        if self.renders_tools:
            native = client([_native(m) for m in messages])
            if tools:
                extra = {**extra, "tools": client([t.as_openai() for t in tools])}
            return self.render(native, **extra)
        return self.render(client(hermes_messages(messages, tools)), **extra)

    def render(self, messages: Sequence[Message], **extra: Any) -> str:
        """``extra`` reaches the template as variables (``date_string`` for Llama 3.1+, which otherwise
        writes today's date)."""
        try:
            return self._render(messages, extra)
        except (ValueError, jinja2.TemplateError) as e:
            first_error = e
        if any(m["role"] == "system" for m in messages):
            try:
                return self._render(fold_system(messages), extra)
            except (ValueError, jinja2.TemplateError):
                pass
        raise ChatTemplateError(f"the model's chat template refuses these messages: {first_error}") from None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # what the model wrote, not JSON: passed on as it is


def _native(m: RequestMessage) -> dict[str, Any]:
    out = m.as_openai()
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in m.tool_calls]
    return out


def hermes_messages(messages: Sequence[RequestMessage], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools (see the module doc)."""
    out: list[dict[str, Any]] = []
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools))
        if messages and messages[0].role == "system":
            prompt = f"{messages[0].content}\n\n{prompt}"
            messages = messages[1:]
        out.append({"role": "system", "content": prompt})
    for m in messages:
        if m.role == "tool":
            response = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
            continue
        content = m.content
        if m.tool_calls:
            # As the engine's grammar writes them (the arguments are the model's own text).
            calls = "\n".join(closed_call_text(c.name, c.arguments or "{}") for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m.role, "content": content})
    for turn in out:
        turn.pop("tool_results", None)
    return out
