"""What a ``POST /api/chat`` asks for: the body ``DefaultChatTransport`` sends (``{id, messages, trigger,
messageId?}`` plus whatever the app's ``body`` option adds), translated into an rsb create body, and the
turn key that tells a repeat of the same turn from a new one."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from broker.errors import InvalidRequest
from broker.request import GenerationRequest

SUBMIT, REGENERATE = "submit-message", "regenerate-message"
MAX_CHAT_ID_CHARS = 256
# Fields of the body besides the SDK's own: generation options an app may add with the transport's `body`
# option, named as in rsb's native create body.
OPTIONS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "cancel_on_disconnect")
_SDK_FIELDS = frozenset({"id", "messages", "trigger", "messageId"})
# UIMessage parts that carry nothing for the model: the SDK's step markers, the model's own reasoning and
# sources, and app data parts. Files and tool calls would change the answer and rsb cannot honour them.
_SKIPPED_PARTS = frozenset({"step-start", "reasoning", "source-url", "source-document"})
_ROLES = frozenset({"system", "user", "assistant"})


@dataclass(frozen=True, slots=True)
class UIMessageRef:
    """What the view reads of one UIMessage: its id, role and text (its text parts joined)."""

    id: str
    role: str
    text: str


@dataclass(frozen=True, slots=True)
class ChatRequest:
    chat_id: str
    trigger: str
    #: The turn's anchor: the body's messageId (an edited user message, a regenerated answer), else the id
    #: of the last user message (a plain send: the SDK makes a new id for every message sent).
    anchor: str
    #: A plain send: a repeat of it is a retry whose answer (even finished) is the same turn. A regenerate
    #: or an edit may repeat an identical body on purpose: a repeat is the same turn only while it runs.
    plain_send: bool
    create_body: dict[str, Any]
    #: The body's messages, in order (the create body's ``messages`` are these, as rsb messages).
    messages: tuple[UIMessageRef, ...] = ()

    def turn_key(self, request: GenerationRequest) -> str:
        """Same chat + same turn key = the same turn. The request's hash is part of it, so a body that
        differs in what it asks for never lands on a turn made for another request."""
        raw = f"{self.trigger}\n{self.anchor}\n{request.request_hash()}".encode()
        return hashlib.sha256(raw).hexdigest()[:32]


def chat_id_of(raw: object) -> str:
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_CHAT_ID_CHARS:
        raise InvalidRequest(f"'id' (the chat id) must be a string of 1 to {MAX_CHAT_ID_CHARS} characters")
    return raw


def _message_text(i: int, m: dict[str, Any]) -> str:
    parts = m.get("parts")
    if not isinstance(parts, list):
        raise InvalidRequest(f"messages[{i}].parts must be a list")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequest(f"messages[{i}].parts[{j}] must be an object with a 'type'")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].parts[{j}].text must be a string")
            texts.append(part["text"])
        elif kind not in _SKIPPED_PARTS and not kind.startswith("data-"):
            raise InvalidRequest(f"messages[{i}].parts[{j}]: '{kind}' parts are not supported (text only)")
    return "".join(texts)


def parse_chat_body(body: dict[str, Any]) -> ChatRequest:
    """Validate the SDK's body (rsb's own validator then checks the create body built from it)."""
    unknown = sorted(set(body) - _SDK_FIELDS - set(OPTIONS))
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)} (besides the SDK's, the body may carry "
                             f"{', '.join(OPTIONS)})")
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
    messages, refs, last_user = [], [], ""
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequest(f"messages[{i}] must be a UI message with a role: system, user or assistant")
        text = _message_text(i, m)
        messages.append({"role": m["role"], "content": text})
        refs.append(UIMessageRef(str(m.get("id") or ""), m["role"], text))
        if m["role"] == "user":
            last_user = str(m.get("id") or "")
    create_body = {"messages": messages, **{k: body[k] for k in OPTIONS if k in body}}
    return ChatRequest(chat_id, trigger, message_id or last_user,
                       plain_send=trigger == SUBMIT and message_id is None, create_body=create_body,
                       messages=tuple(refs))
