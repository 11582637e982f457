"""Chat templates: ``messages`` to the prompt text a model was trained on, rendered with the model's own
template (GGUF ``tokenizer.chat_template``) exactly as transformers and llama-cpp-python render it
(``Jinja2ChatFormatter``: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``).

Kept apart from the engine so that a template can be checked against hand-written prompts without a model
(tests/generator/test_chat_templates.py, one test per template family). What rsb adds to the template:
- a template that refuses the ``system`` role (Gemma's "System role not supported") gets the system prompt
  folded into the first user turn, separated by a blank line, as llama.cpp's own chat code does;
- any other refusal (roles that do not alternate, an unsupported role) is an ``invalid_request`` error
  event carrying the template's own message, not an engine crash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from generator.engines.base import EngineError

#: Used when a GGUF carries no chat template: the plain role-tagged format of the demo model.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

Message = Mapping[str, str]


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
