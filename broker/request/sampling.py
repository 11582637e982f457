"""The range of every sampling parameter (``Range``: temperature's and top_p's too, which broker.request.generation
reads), and the sampling and tool-count parameters beyond temperature and top_p, as a create carries them: OpenAI's
presence and frequency penalties, ``logit_bias``, ``parallel_tool_calls``, ``max_tool_calls``, ``logprobs`` and
``top_logprobs``, and ``top_k`` (Anthropic's, vLLM's, Ollama's: sample among the k likeliest tokens). Validated here
(OpenAI's ranges), stored in the canonical request only when set (so a request without them keeps its hash), honoured by
the engines (generator.engines.sampler applies the penalties and biases to the logits; the answer stops at the call
past ``max_calls``, generator.answer) and echoed by the views."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from broker.ascii import decimal
from broker.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric parameter may take, inclusive (OpenAI's ranges): what validation checks and what the API's
    document says (consumer.views.openapi)."""

    lo: float
    hi: float

    def holds(self, v: object) -> bool:
        return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and self.lo <= v <= self.hi


#: temperature and top_p (broker.request.generation: their defaults too), the penalties, a logit bias, a seed.
TEMPERATURE, TOP_P = Range(0.0, 2.0), Range(0.0, 1.0)
PENALTY, LOGIT_BIAS = Range(-2, 2), Range(-100, 100)
SEED = Range(0, 2**32 - 1)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_TOOL_CALLS = 128
MAX_TOP_LOGPROBS = 20
#: Past any vocabulary: a bound on what a request may say, not on what it means (k over the vocabulary, or 0: all).
MAX_TOP_K = 1_000_000
FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias", "parallel_tool_calls", "max_tool_calls", "logprobs",
          "top_logprobs", "top_k")


@dataclass(frozen=True, slots=True)
class Sampling:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias from -100 to 100): -100 bans the token, 100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    #: The log-probability of each text token (and of the ``top_logprobs`` likeliest in its place): logprobs events.
    logprobs: bool = False
    top_logprobs: int = 0
    #: Sample among the k likeliest tokens (0: among all); None: the engine's default.
    top_k: int | None = None

    @property
    def max_calls(self) -> int | None:
        """The most calls one answer may make (None: no bound)."""
        return self.max_tool_calls if self.parallel_tool_calls else 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def stored(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            out["frequency_penalty"] = self.frequency_penalty
        if self.logit_bias:
            out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        if not self.parallel_tool_calls:
            out["parallel_tool_calls"] = False
        if self.max_tool_calls is not None:
            out["max_tool_calls"] = self.max_tool_calls
        if self.logprobs:
            out["logprobs"] = True
        if self.top_logprobs:
            out["top_logprobs"] = self.top_logprobs
        if self.top_k is not None:
            out["top_k"] = self.top_k
        return out

    @classmethod
    def from_stored(cls, d: dict[str, Any]) -> Sampling:
        return cls(d.get("presence_penalty", 0.0), d.get("frequency_penalty", 0.0),
                   tuple((int(t), float(b)) for t, b in (d.get("logit_bias") or {}).items()),
                   d.get("parallel_tool_calls", True), d.get("max_tool_calls"), d.get("logprobs", False),
                   d.get("top_logprobs", 0), d.get("top_k"))


DEFAULT = Sampling()


def _penalty(body: dict[str, Any], name: str) -> float:
    v = body.get(name)
    if v is None:
        return 0.0
    if not PENALTY.holds(v):
        raise InvalidRequest.at((name,), f" must be a number between {PENALTY.lo} and {PENALTY.hi}")
    return float(v)


def parse_sampling(body: dict[str, Any]) -> Sampling:
    """The sampling fields of a create body (DEFAULT when it has none)."""
    if not any(body.get(f) is not None for f in FIELDS):
        return DEFAULT
    raw_bias = body.get("logit_bias")
    bias: list[tuple[int, float]] = []
    if raw_bias is not None:
        if not isinstance(raw_bias, dict) or len(raw_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest.at(("logit_bias",), f" must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for k, v in raw_bias.items():
            token = decimal(k) if isinstance(k, str) and len(k) <= 9 else None
            if token is None or not LOGIT_BIAS.holds(v):
                raise InvalidRequest.at(("logit_bias",), " maps token ids (\"123\") to numbers between "
                                        f"{LOGIT_BIAS.lo} and {LOGIT_BIAS.hi}")
            bias.append((token, float(v)))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest.at(("parallel_tool_calls",), " must be true or false")
    most = body.get("max_tool_calls")
    if isinstance(most, float) and most.is_integer():  # 7.0 is an integer in JSON
        most = int(most)
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_TOOL_CALLS):
        raise InvalidRequest.at(("max_tool_calls",), f" must be an integer between 1 and {MAX_TOOL_CALLS}")
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise InvalidRequest.at(("logprobs",), " must be true or false")
    top = body.get("top_logprobs")
    if isinstance(top, float) and top.is_integer():
        top = int(top)
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise InvalidRequest.at(("top_logprobs",), f" must be an integer between 0 and {MAX_TOP_LOGPROBS}")
    if top and not want:
        raise InvalidRequest.at(("top_logprobs",), " needs 'logprobs': true")
    top_k = body.get("top_k")
    if isinstance(top_k, float) and top_k.is_integer():
        top_k = int(top_k)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K):
        raise InvalidRequest.at(("top_k",), f" must be an integer between 0 and {MAX_TOP_K}")
    return Sampling(_penalty(body, "presence_penalty"), _penalty(body, "frequency_penalty"), tuple(sorted(bias)),
                    parallel is not False, most, bool(want), top or 0, top_k)
