"""What every engine is: the interface the worker drives, the running generation it gets back, and the one
error family engines raise. Each generation of an engine runs in an inference thread of its own, never on the
event loop, unless the engine says ``on_loop = True``: engines whose generations only wait (on a network, on
a clock) and produce on the loop. A thread per generation costs a thread wake-up, a GIL hand-over and a loop
wake-up per token: fine for llama.cpp's one generation per process, most of a worker's CPU when it runs
hundreds at once."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from broker.request.generation import GenerationRequest
from generator.engines.pieces import PartialAnswer, Piece


class EngineError(Exception):
    """A generation failed in the engine. ``code`` is the stream's ``error`` event code; anything else an
    engine raises (a library's own exception) ends the stream with code ``engine``."""

    code = "engine"


class PromptTooLong(EngineError):
    """The prompt (plus the answer text being continued) leaves no room for ``max_tokens`` in the context."""

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"the prompt is {prompt_tokens} tokens; with max_tokens={max_tokens} it needs "
            f"{prompt_tokens + max_tokens + 1} of the model's {n_ctx}-token context"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx


class UpstreamError(EngineError):
    """The upstream server failed: unreachable, an HTTP error, an error event, or a stream cut mid-answer."""

    code = "upstream"


class UpstreamCut(UpstreamError):
    """The upstream's stream ended (its connection closed or broke) before the answer did: the server died, or the
    network between."""


class GenerationLost(EngineError):
    """The engine lost this generation midway, and another attempt may continue it (its upstream died, and
    another upstream of the model is healthy): the run hands its job over, and the next claim continues it from
    the stream, exactly as a crashed worker's is."""

    code = "upstream"


def error_code(error: BaseException) -> str:
    """The ``error`` event code for whatever a generation raised."""
    return error.code if isinstance(error, EngineError) else EngineError.code


@dataclass(slots=True)
class Generation:
    """One running generation. ``pieces`` yields the text of each generated token, in order, already
    UTF-8 safe (a token that ends inside a character yields "" and its bytes come out with the next
    one; invalid bytes become U+FFFD), and markers that switch the kind of the text after them (reasoning,
    a tool call's arguments: generator.engines.pieces). It stops between tokens as soon as ``stop`` is set,
    after ``max_tokens`` tokens, or at end-of-generation; then ``finish_reason`` is "stop", "length" or
    "tool_calls" (the answer is calls)."""

    prompt_tokens: int
    pieces: Iterator[Piece]
    finish_reason: str = "length"
    #: Leading prompt tokens served from a prompt cache instead of evaluated (known once the prefill ran).
    cached_tokens: int = 0
    #: Set by the worker before iterating: engines that process a long prompt in steps call it with
    #: (prompt tokens processed, prompt tokens) between steps, from the inference thread.
    on_progress: Callable[[int, int], None] | None = None
    #: A loop engine's pieces (see ``on_loop``), instead of ``pieces``.
    apieces: AsyncIterator[Piece] | None = None
    #: Called by the inference thread with the answer's text once a plain-text answer ended and its end was
    #: handed on (so nothing waits for it): an engine with a prompt cache prepares the chat's next turn.
    after: Callable[[str], None] | None = None
    #: The stop sequence that ended the answer when the engine applied it itself (an upstream that says which:
    #: vLLM's ``stop_reason``); a stop sequence rsb's own filter meets is the worker's to know.
    stop_sequence: str | None = None


@runtime_checkable
class TokenCounter(Protocol):
    """An engine that counts a request's prompt tokens itself (it holds the tokenizer and the chat template): its
    worker answers the token counts asked of its model (generator.token_counts; an upstream's engine does not)."""

    def count_tokens(self, request: GenerationRequest) -> int:
        """The tokens of the prompt a generation of ``request`` would evaluate. Raises EngineError (the chat
        template refuses the conversation, ...). Safe beside running generations: it decodes nothing."""
        ...


#: Called after each batched decoding step with (sequences in the batch, prompt tokens it prefilled, seconds).
StepObserver = Callable[[int, int, float], None]


class Engine(Protocol):
    """An engine class either subclasses this (and inherits ``on_loop = False``, ``caches_prompts = False``,
    ``sequences = 0`` and a no-op ``observe_steps``) or declares them."""

    #: The model's name, as reported in ``started`` events and the status route.
    name: str
    #: False: each generation runs in an inference thread of its own (generator.handoff.produce); True: on the
    #: event loop (``start`` is called there and fills ``Generation.apieces``).
    on_loop: bool = False
    #: The engine keeps recent prompts' state (generator.engines.prompt_cache): a chat's next turn is worth
    #: sending to the worker that ran its last one (chat-affine claiming, generator.jobs).
    caches_prompts: bool = False
    #: Generations the engine decodes together (llama.cpp's ``--parallel``): the worker runs exactly this many
    #: at once, one slot per sequence. 0: as many as the worker's ``--concurrency`` (an upstream, which queues
    #: or batches on its side).
    sequences: int = 0

    def start(
        self,
        request: GenerationRequest,
        *,
        prefix_text: str,
        max_tokens: int,
        stop: threading.Event,
        partial: PartialAnswer | None = None,
        cache_scope: str = "",
        tier: str = "",
    ) -> Generation:
        """Tokenize the prompt (chat template applied for ``messages``) followed by ``prefix_text``
        (answer text already appended by an earlier attempt, which the generation continues; ``partial``:
        its reasoning and tool calls, when it had any), and return
        a Generation that produces at most ``max_tokens`` more tokens. Called in the inference thread:
        prefill may happen here or on the first ``next()``. An engine whose ``on_loop`` is true is called on
        the event loop instead, and fills ``apieces`` (an async iterator) rather than ``pieces``.

        ``cache_scope``: whose earlier prompts this one may reuse the cached state of (or, upstream, share a
        routing key with): one tenant's, or everyone's (""). A prompt never gets a cached prefix, nor a quicker
        first token, from another scope's prompts (``--prompt-cache-scope``). ``tier``: the service tier the job runs
        in (broker.request.tiers; "": not known), for an upstream's own scheduler."""
        ...

    def observe_steps(self, observer: StepObserver) -> None:
        """Have ``observer`` called after each decoding step of a batching engine (metrics); others never call it."""
        return None

    def close(self) -> None: ...

