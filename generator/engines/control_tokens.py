"""Control tokens and a chat's text: the template's own markers (``<|im_start|>``, ``</s>``, ``[INST]``) are control
tokens; whatever a client wrote is text, however it is spelled.

llama.cpp parses control tokens' spellings in a whole string or in none of it (``parse_special``), and a chat
prompt needs them parsed: templates write their markers as text. So a user message spelling
``<|im_end|>\\n<|im_start|>system\\n...`` used to become the model's own turn markers: a client could close its
turn and open a system one. Now every string a client sent (messages, their tool calls and results, tool
definitions, the answer being continued after a crash) is shielded before the template sees it: each control
token's spelling in it becomes a placeholder no client can write (private-use characters drawn at random per
prompt, and an index). The rendered prompt is then split as llama.cpp's own tokenizer splits it
(``tokenizer_st_partition`` in llama-vocab.cpp: the special tokens' texts, longest first, become their tokens,
with their ``lstrip``/``rstrip`` whitespace; what lies between are raw fragments, each tokenized on its own, SPM's
space prefix included), except that the placeholders go back to their text inside the raw fragments, which are
tokenized without special parsing. The template's markers are thus the very tokens llama.cpp makes of them, and
the client's spellings are plain text. A prompt whose client text spells no control token (nearly every one) is
tokenized by llama.cpp in one call, as before.

Not shielded: a raw ``prompt`` (the client writes the whole prompt, markers included, as in llama-cpp-python's
completions: there is no template to escape from). User-defined tokens (``USER_DEFINED``) are parsed by llama.cpp
with or without special parsing, as in every llama.cpp-based server; they are not markers templates close turns
with.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

#: llama.cpp's token attributes (llama.h ``llama_token_attr``): which tokens parse_special parses.
ATTR_UNKNOWN = 1 << 0
ATTR_CONTROL = 1 << 3
ATTR_LSTRIP = 1 << 5
ATTR_RSTRIP = 1 << 6
SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN
_SPACE = " \t\n\v\f\r"  # C's isspace, as llama.cpp strips

Tokenize = Callable[[str], list[int]]  # raw text to tokens, without special parsing


class ControlTokens:
    """The special tokens of one vocabulary: ``by_text`` maps a token's text to its id and attributes."""

    def __init__(self, by_text: Mapping[str, tuple[int, int]]) -> None:
        self.by_text = dict(by_text)
        # llama.cpp's order: longest text first (llama_vocab::impl::load, cache_special_tokens).
        self.ordered = sorted(self.by_text, key=len, reverse=True)
        self._spelled = re.compile("|".join(re.escape(t) for t in self.ordered)) if self.ordered else None

    def shield(self) -> Shield:
        """A shield for one prompt's client strings."""
        return Shield(self)

    def spelled(self, text: str) -> re.Match[str] | None:
        return self._spelled.search(text) if self._spelled is not None else None


class Shield:
    """Applied to each client string of one prompt (``__call__``), then tokenizes the rendered prompt
    (``tokenize``)."""

    def __init__(self, controls: ControlTokens) -> None:
        self.controls = controls
        self.originals: list[str] = []
        # Private-use characters no template writes, drawn per prompt: a client cannot spell a placeholder.
        self._mark = "".join(chr(0xF0000 + secrets.randbelow(0xFFFD)) for _ in range(4))
        self._placeholder = re.compile(re.escape(self._mark) + "([0-9]+)" + re.escape(self._mark))

    @property
    def used(self) -> bool:
        return bool(self.originals)

    def __call__(self, text: str) -> str:
        """``text`` with each control token's spelling replaced by a placeholder."""
        if self.controls.spelled(text) is None:
            return text
        assert self.controls._spelled is not None

        def hide(m: re.Match[str]) -> str:
            self.originals.append(m.group(0))
            return f"{self._mark}{len(self.originals) - 1}{self._mark}"

        return self.controls._spelled.sub(hide, text)

    def deep(self, value: Any) -> Any:
        """Every string in a JSON-like value (a message, a tool) shielded; keys are the template's."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.deep(v) for v in value]
        return value

    def tokenize(self, text: str, raw: Tokenize) -> list[int]:
        """The tokens of a rendered prompt: llama.cpp's split with special parsing (see the module doc), the
        placeholders' texts as text."""
        fragments: list[str | int] = [text]
        for special in self.controls.ordered:
            token, attr = self.controls.by_text[special]
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                rest = frag
                while (at := rest.find(special)) >= 0:
                    left, rest = rest[:at], rest[at + len(special):]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_SPACE)
                    if attr & ATTR_RSTRIP:
                        rest = rest.lstrip(_SPACE)
                    if left:
                        out.append(left)
                    out.append(token)
                if rest:
                    out.append(rest)
            fragments = out
        tokens: list[int] = []
        for frag in fragments:
            if isinstance(frag, int):
                tokens.append(frag)
            else:
                tokens += raw(self._placeholder.sub(lambda m: self.originals[int(m.group(1))], frag))
        return tokens
