"""What server an upstream is (``--upstream-api``), and so what it is sent beyond its protocol's request: each
server takes fields of its own, and OpenAI itself refuses any field it does not know ("Unrecognized request
argument supplied"), so a field goes only to the kinds that accept it.

| kind | protocol | fields of its own |
| --- | --- | --- |
| ``openai`` | openai | none: OpenAI's own fields only (any OpenAI-compatible server rsb knows no more of) |
| ``vllm`` | openai | ``cache_salt``, ``priority``, ``ignore_eos`` |
| ``llama.cpp`` | openai | ``ignore_eos`` |
| ``ollama`` | ollama | ``keep_alive`` |

- ``cache_salt`` (vLLM's prefix cache, salted): a digest of the tenant whose prompts a prompt may share cached state
  with (``--prompt-cache-scope``), so vLLM's cache is scoped per tenant as rsb's in-process one is: one key gets no
  cached prefix, nor a quicker first token, from another's prompts. vLLM takes any non-empty string and asks for one
  of 256 bits (43 base64 characters); none is sent with the global scope (one shared cache).
- ``priority`` (vLLM's ``--scheduling-policy priority``: a lower value runs earlier): the job's tier, ``priority``
  -1, ``flex`` 1, ``default`` none (0). A vLLM without that policy refuses any value but 0; the engine then drops the
  field for that server for good and sends the request again.
- ``ignore_eos``: ``--ignore-eos`` (benchmarks, tests), where the server has it.
- ``keep_alive``: ``--upstream-keep-alive``: how long Ollama keeps the model loaded after a request (its default
  unloads an idle model after 5 minutes, and the next request pays its load).

Without ``--upstream-api``, a URL ending in ``/api`` is Ollama's, and an OpenAI-compatible server is what its model
list says: vLLM's cards are ``owned_by: vllm``, llama.cpp's server's ``llamacpp``; anything else is ``openai``.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.ascii import decimal
from generator.engines.upstream.ollama import OLLAMA
from generator.engines.upstream.openai import OPENAI
from generator.engines.upstream.protocol import UpstreamProtocol

#: vLLM's priority per tier (broker.request.tiers.TIERS; lower runs earlier); the default tier sends none.
VLLM_PRIORITY = {"priority": -1, "flex": 1}


@dataclass(frozen=True, slots=True)
class UpstreamKind:
    name: str
    protocol: UpstreamProtocol
    cache_salt: bool = False
    priority: bool = False
    ignore_eos: bool = False
    keep_alive: bool = False
    #: What the server's model list says in ``owned_by``, by which an OpenAI-compatible server is recognised.
    owned_by: str | None = None

    def fields(self, *, cache_scope: str, tier: str, ignore_eos: bool, keep_alive: str,
               priority: bool = True) -> dict[str, Any]:
        """The fields of its own this kind of server gets for a job of ``tier`` whose prompts share cached state
        with ``cache_scope`` (Engine.start's; ``priority``: False once this server refused it)."""
        out: dict[str, Any] = {}
        if self.cache_salt and cache_scope:
            out["cache_salt"] = cache_salt(cache_scope)
        if self.priority and priority and (value := VLLM_PRIORITY.get(tier)) is not None:
            out["priority"] = value
        if self.ignore_eos and ignore_eos:
            out["ignore_eos"] = True
        if self.keep_alive and keep_alive:
            seconds = decimal(keep_alive.removeprefix("-"))  # a number is seconds (negative: for ever); else "30m"
            out["keep_alive"] = keep_alive if seconds is None else -seconds if keep_alive[0] == "-" else seconds
        return out


OPENAI_KIND = UpstreamKind("openai", OPENAI)
VLLM = UpstreamKind("vllm", OPENAI, cache_salt=True, priority=True, ignore_eos=True, owned_by="vllm")
LLAMA_CPP = UpstreamKind("llama.cpp", OPENAI, ignore_eos=True, owned_by="llamacpp")
OLLAMA_KIND = UpstreamKind("ollama", OLLAMA, keep_alive=True)
KINDS: dict[str, UpstreamKind] = {k.name: k for k in (OPENAI_KIND, VLLM, LLAMA_CPP, OLLAMA_KIND)}


def cache_salt(scope: str) -> str:
    """vLLM's ``cache_salt`` for a cache scope: 256 bits of its digest, base64url (43 characters)."""
    digest = hashlib.sha256(b"rsb cache salt\x00" + scope.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def kind_of_listing(listing: object) -> UpstreamKind | None:
    """The kind an OpenAI-compatible server's model list names (``owned_by`` of its first card), if rsb knows it."""
    data = listing.get("data") if isinstance(listing, Mapping) else None
    first = data[0] if isinstance(data, list) and data else None
    owner = first.get("owned_by") if isinstance(first, Mapping) else None
    return next((k for k in KINDS.values() if k.owned_by is not None and k.owned_by == owner), None)
