"""The inference engine interface the worker drives. Engines run in a worker thread, never on the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from broker.request import GenerationRequest


@dataclass(slots=True)
class Generation:
    """One running generation. ``pieces`` yields the text of each generated token, in order, already
    UTF-8 safe (a token that ends inside a character yields "" and its bytes come out with the next
    one; invalid bytes become U+FFFD). It stops between tokens as soon as ``stop`` is set, after
    ``max_tokens`` tokens, or at end-of-generation; then ``finish_reason`` is "stop" or "length"."""

    prompt_tokens: int
    pieces: Iterator[str]
    finish_reason: str = "length"
    #: Set by the worker before iterating: engines that process a long prompt in steps call it with
    #: (prompt tokens processed, prompt tokens) between steps, from the inference thread.
    on_progress: Callable[[int, int], None] | None = None


class Engine(Protocol):
    #: The model's name, as reported in ``started`` events and the status route.
    name: str

    def start(
        self,
        request: GenerationRequest,
        *,
        prefix_text: str,
        max_tokens: int,
        stop: threading.Event,
    ) -> Generation:
        """Tokenize the prompt (chat template applied for ``messages``) followed by ``prefix_text``
        (answer text already appended by an earlier attempt, which the generation continues), and return
        a Generation that produces at most ``max_tokens`` more tokens. Called in the inference thread:
        prefill may happen here or on the first ``next()``."""
        ...

    def close(self) -> None: ...
