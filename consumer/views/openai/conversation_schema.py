"""The OpenAPI description of the Conversations API (consumer/views/openai/conversations.py), built from the
same bounds the view checks. consumer/views/openai/schema.py hands it the shapes it shares with the Responses
view (an input item, the error responses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.request.generation import RequestLimits
from consumer.schema import json_response, nullable
from consumer.views.openai import conversations as conv

Err = Callable[[str], dict[str, Any]]

_CONVERSATION = {"type": "object", "required": ["id", "object", "created_at", "metadata"], "properties": {
    "id": {"type": "string", "pattern": "^conv_[0-9a-f]{32}$"}, "object": {"const": "conversation"},
    "created_at": {"type": "integer"}, "metadata": {"type": "object"}}}
_ITEM = {"type": "object", "required": ["type", "id"], "properties": {
    "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]}, "id": {"type": "string"}}}
_LIST = {"type": "object", "required": ["object", "data", "first_id", "last_id", "has_more"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": _ITEM},
    "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]}, "has_more": {"type": "boolean"}}}
_DELETED = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
    "id": {"type": "string"}, "object": {"const": "conversation.deleted"}, "deleted": {"const": True}}}
METADATA = nullable({"type": "object", "maxProperties": conv.MAX_METADATA_PAIRS,
                     "propertyNames": {"minLength": 1, "maxLength": conv.MAX_METADATA_KEY},
                     "additionalProperties": {"type": "string", "maxLength": conv.MAX_METADATA_VALUE}})
_LINKS = {name: {"operationId": op, "parameters": {"conversation_id": "$response.body#/id"}}
          for name, op in (("retrieve", "openaiRetrieveConversation"), ("items", "openaiListConversationItems"),
                           ("delete", "openaiDeleteConversation"))}


def conversation_paths(item: dict[str, Any], limits: RequestLimits, err: Err, common: dict[str, Any],
                       limited: dict[str, Any]) -> dict[str, Any]:
    """``item``: the schema of one Responses input item (what items to add are)."""
    cid = {"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}
    prompt_chars = limits.max_prompt_chars
    items = {"type": "array", "minItems": 1, "maxItems": min(conv.MAX_ITEMS, limits.max_messages), "items": item}
    chars = f"the items' content is at most {prompt_chars} characters in all"
    missing = {"404": err("no conversation with this id (or another API key's)")}
    return {
        "/v1/conversations": {"post": {
            "operationId": "openaiCreateConversation", "summary": "OpenAI Conversations: create",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "description": chars,
                "properties": {"items": nullable(items), "metadata": METADATA}}}}},
            "responses": {"200": {**json_response("the conversation", _CONVERSATION), "links": _LINKS},
                          "400": err("invalid items or metadata"), "413": err("body too large"),
                          **limited, **common}}},
        "/v1/conversations/{conversation_id}": {
            "get": {"operationId": "openaiRetrieveConversation", "parameters": [cid],
                    "responses": {"200": json_response("the conversation", _CONVERSATION), **missing, **common}},
            "post": {"operationId": "openaiUpdateConversation", "parameters": [cid],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "type": "object", "additionalProperties": False, "required": ["metadata"],
                         "properties": {"metadata": METADATA}}}}},
                     "responses": {"200": json_response("the conversation", _CONVERSATION),
                                   "400": err("invalid metadata"), **missing, **common}},
            "delete": {"operationId": "openaiDeleteConversation", "parameters": [cid],
                       "responses": {"200": json_response("deleted", _DELETED), **missing, **common}}},
        "/v1/conversations/{conversation_id}/items": {
            "get": {"operationId": "openaiListConversationItems", "parameters": [
                cid, {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": conv.LIST_LIMIT_MAX}},
                {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
                {"name": "include", "in": "query", "required": False,
                 "schema": {"type": "array", "items": {"type": "string"}}}],
                    "responses": {"200": json_response("a page of the conversation's items", _LIST),
                                  "400": err("invalid limit or order"),
                                  "404": err("no conversation with this id, or no item with the id 'after' names"),
                                  **common}},
            "post": {"operationId": "openaiAddConversationItems", "parameters": [cid],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "type": "object", "additionalProperties": False, "required": ["items"], "description": chars,
                         "properties": {"items": items}}}}},
                     "responses": {"200": json_response("the items added", _LIST), "400": err("invalid items"),
                                   "409": err("a response of this conversation is running"),
                                   "413": err("body too large"), **missing, **common}}},
        "/v1/conversations/{conversation_id}/items/{item_id}": {"get": {
            "operationId": "openaiRetrieveConversationItem",
            "parameters": [cid, {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": json_response("the item", _ITEM),
                          "404": err("no such conversation, or no such item in it"), **common}}},
    }
