"""What a ``POST /api/chat`` asks for: the body ``DefaultChatTransport`` sends (``{id, messages, trigger,
messageId?}`` plus whatever the app's ``body`` option adds), translated into an rsb create body, and the
turn key that tells a repeat of the same turn from a new one.

UI messages become rsb's (OpenAI's) messages. An assistant message is one or more steps (``step-start``
parts), each one model call: its text parts are the assistant message's content, its tool parts
(``tool-<name>`` or ``dynamic-tool``) its tool calls (``toolCallId``, the name, the input as JSON text), and
each call's result (``output-available``: the output, a string as it is, anything else as JSON text, as the
SDK's own converter sends it; ``output-error``: the error text) a ``tool`` message after it. A call without
a result is refused: the model would be asked to go on from a call nobody answered.

A request whose last message is an assistant message **continues** it: the SDK sends that after
``addToolOutput`` (with ``sendAutomaticallyWhen``), and expects the answer to land in the same message, as its
next step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from broker.errors import InvalidRequest
from broker.request.generation import GenerationRequest
from broker.request.on_busy import parse_on_busy

SUBMIT, REGENERATE = "submit-message", "regenerate-message"
MAX_CHAT_ID_CHARS = 256
MAX_MESSAGE_ID_CHARS = 256
# Fields of the body besides the SDK's own: generation options an app may add with the transport's `body`
# option, named as in rsb's native create body (tools, tool_choice and response_format in OpenAI's shapes).
OPTIONS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "cancel_on_disconnect", "tools",
           "tool_choice", "response_format")
_SDK_FIELDS = frozenset({"id", "messages", "trigger", "messageId"})
#: rsb's own field besides the generation options: what the turn does while another of the chat runs
#: (broker.request.on_busy).
ON_BUSY_FIELD = "on_busy"
# UIMessage parts that carry nothing for the model: the SDK's step markers, the model's own reasoning (models
# are not given their past reasoning) and sources, and app data parts. Files would change the answer and rsb
# cannot honour them.
_SKIPPED_PARTS = frozenset({"reasoning", "source-url", "source-document"})
_ROLES = frozenset({"system", "user", "assistant"})
#: The states of a tool part that carry the call's result.
RESULT_STATES = ("output-available", "output-error")
# A turn key is the request's digest, and for a continuation ":" and the id of the message it continues.
_CONTINUES = ":"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    chat_id: str
    trigger: str
    #: The turn's anchor: the body's messageId (an edited user message, a regenerated answer, the message a
    #: tool result continues), else the id of the last user message (a plain send: the SDK makes a new id for
    #: every message sent).
    anchor: str
    #: A plain send: a repeat of it is a retry whose answer (even finished) is the same turn. A regenerate
    #: or an edit may repeat an identical body on purpose: a repeat is the same turn only while it runs.
    plain_send: bool
    create_body: dict[str, Any]
    #: The id of the assistant message this turn continues (its last message), or None: a new message.
    continues: str | None = None
    #: For each of the create body's ``messages``, the id of the UI message it comes from (an assistant UI
    #: message becomes several: its steps and its calls' results).
    message_ids: tuple[str, ...] = ()
    #: What the turn does while another of the chat runs (broker.request.on_busy; None: the key's default).
    on_busy: str | None = None

    def turn_key(self, request: GenerationRequest) -> str:
        """Same chat + same turn key = the same turn. The request's hash is part of it, so a body that
        differs in what it asks for never lands on a turn made for another request."""
        raw = f"{self.trigger}\n{self.anchor}\n{request.request_hash()}".encode()
        digest = hashlib.sha256(raw).hexdigest()[:32]
        return digest if self.continues is None else f"{digest}{_CONTINUES}{self.continues}"


def chat_id_of(raw: object) -> str:
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_CHAT_ID_CHARS:
        raise InvalidRequest(f"'id' (the chat id) must be a string of 1 to {MAX_CHAT_ID_CHARS} characters")
    return raw


def _tool_name(part: dict[str, Any], kind: str) -> object:
    return part.get("toolName") if kind == "dynamic-tool" else kind[len("tool-"):]


def _tool_content(part: dict[str, Any]) -> str:
    """A call's result as the model reads it (the SDK's converter: a string output as it is, any other value
    as JSON text, an error as its text)."""
    if part["state"] == "output-error":
        return str(part.get("errorText") or "")
    output = part.get("output")
    return output if isinstance(output, str) else orjson.dumps(output).decode()


def _arguments(part: dict[str, Any]) -> str:
    """A call's input as JSON text; an input the SDK could not parse (``tool-input-error``) keeps its raw text."""
    if part.get("input") is None and isinstance(part.get("rawInput"), str):
        return str(part["rawInput"])
    return orjson.dumps(part.get("input") if part.get("input") is not None else {}).decode()


class _Steps:
    """An assistant message's steps as rsb messages: each step's text and calls, then the calls' results."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.out: list[dict[str, Any]] = []
        self.texts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []

    def flush(self) -> None:
        if self.texts or self.calls:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts)}
            if self.calls:
                message["tool_calls"] = self.calls
            self.out += [message, *self.results]
        self.texts, self.calls, self.results = [], [], []

    def text(self, text: str) -> None:
        if self.calls:  # text after a call is the next model call's (a message built without step-start)
            self.flush()
        self.texts.append(text)

    def tool(self, j: int, part: dict[str, Any], kind: str) -> None:
        where = f"{self.at}.parts[{j}]"
        name, call_id, state = _tool_name(part, kind), part.get("toolCallId"), part.get("state")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise InvalidRequest(f"{where}: a tool part needs a toolCallId and a tool name")
        if state not in RESULT_STATES:
            raise InvalidRequest(f"{where}: tool call {call_id[:64]!r} has no result (state {state!r}): give it "
                                 "its output (addToolOutput) before the chat goes on")
        function = {"name": name, "arguments": _arguments(part)}
        self.calls.append({"id": call_id, "type": "function", "function": function})
        self.results.append({"role": "tool", "tool_call_id": call_id, "content": _tool_content(part)})


def _parts(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    parts = m.get("parts")
    if not isinstance(parts, list):
        raise InvalidRequest(f"messages[{i}].parts must be a list")
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"messages[{i}].parts[{j}] must be an object with a 'type'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise InvalidRequest(f"messages[{i}].parts[{j}].text must be a string")
    return parts


def _is_tool(kind: str) -> bool:
    return kind == "dynamic-tool" or kind.startswith("tool-")


def _skipped(kind: str) -> bool:
    return kind in _SKIPPED_PARTS or kind.startswith("data-")


def _messages(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    """One UI message as rsb messages (an assistant's: one or more, see the module's docstring)."""
    parts = _parts(i, m)
    if m["role"] != "assistant":
        texts = []
        for j, part in enumerate(parts):
            if part["type"] == "text":
                texts.append(part["text"])
            elif not (_skipped(part["type"]) or part["type"] == "step-start"):
                raise InvalidRequest(f"messages[{i}].parts[{j}]: '{part['type']}' parts are not supported in a "
                                     f"{m['role']} message (text only)")
        return [{"role": m["role"], "content": "".join(texts)}]
    steps = _Steps(f"messages[{i}]")
    for j, part in enumerate(parts):
        kind = part["type"]
        if kind == "step-start":
            steps.flush()
        elif kind == "text":
            steps.text(part["text"])
        elif _is_tool(kind):
            steps.tool(j, part, kind)
        elif not _skipped(kind):
            raise InvalidRequest(f"messages[{i}].parts[{j}]: '{kind}' parts are not supported (text and tool "
                                 "parts are)")
    steps.flush()
    return steps.out or [{"role": "assistant", "content": ""}]


def parse_chat_body(body: dict[str, Any]) -> ChatRequest:
    """Validate the SDK's body (rsb's own validator then checks the create body built from it)."""
    unknown = sorted(set(body) - _SDK_FIELDS - set(OPTIONS) - {ON_BUSY_FIELD})
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)} (besides the SDK's, the body may carry "
                             f"{', '.join(OPTIONS)}, {ON_BUSY_FIELD})")
    on_busy = parse_on_busy(body.get(ON_BUSY_FIELD))
    chat_id = chat_id_of(body.get("id"))
    trigger = body.get("trigger", SUBMIT)
    if trigger not in (SUBMIT, REGENERATE):
        raise InvalidRequest(f"'trigger' must be '{SUBMIT}' or '{REGENERATE}'")
    message_id = body.get("messageId")
    if message_id is not None and (not isinstance(message_id, str) or not message_id):
        raise InvalidRequest("'messageId' must be a non-empty string")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list of UI messages")
    messages: list[dict[str, Any]] = []
    message_ids: list[str] = []
    last_user = ""
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequest(f"messages[{i}] must be a UI message with a role: system, user or assistant")
        expanded = _messages(i, m)
        messages += expanded
        message_ids += [str(m.get("id") or "")] * len(expanded)
        if m["role"] == "user":
            last_user = str(m.get("id") or "")
    continues = None
    if raw[-1]["role"] == "assistant" and trigger == SUBMIT:
        continues = raw[-1].get("id")
        if not isinstance(continues, str) or not 0 < len(continues) <= MAX_MESSAGE_ID_CHARS:
            raise InvalidRequest(f"messages[{len(raw) - 1}].id (the assistant message this turn continues) must be "
                                 f"a string of 1 to {MAX_MESSAGE_ID_CHARS} characters")
    create_body = {"messages": messages, **{k: body[k] for k in OPTIONS if k in body}}
    return ChatRequest(chat_id, trigger, message_id or last_user,
                       plain_send=trigger == SUBMIT and message_id is None, create_body=create_body,
                       continues=continues, message_ids=tuple(message_ids), on_busy=on_busy)
