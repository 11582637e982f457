"""How big the grammar that enforces a schema gets, bounded at create (broker.schema.enforceable calls it) beside what
the grammar costs per token (broker.schema.cost).

Two parts of rsb's grammar grow with a schema's numbers rather than its size, so that 27 KB of JSON once cost a
generator 16 s of Python and an 11 MB grammar while its other streams ran 2.4-3.3x slower:

- a bounded integer (``minimum``, ``maximum``, ``exclusive*``, ``multipleOf``) is written digit by digit by an
  automaton (generator.engines.number_grammar) whose states are the digits still tight with each bound, the
  digits left and the remainder modulo ``multipleOf``: about (digits of the low bound + digits of the high one + 2 x
  the longest length) x ``multipleOf`` rules. Measured: one integer of +-(2**53 - 1) with ``multipleOf`` 97 is 2,359
  rules (349 KB, 28 ms); ten with multipleOf 91 to 100, 12,820 rules (2 MB, 0.35-1 s). Integers with the same
  bounds and step share their rules, and those with the same step share the states tight with neither bound; so
  does the estimate (DIGIT_STATES counts each share once);
- a repetition ``{m,n}`` (``maxLength``, ``maxItems``, a pattern's counts) is spelled out by llama.cpp as about n
  rules when it reads the grammar: 200 arrays of up to 1,000 strings of up to 1,000 characters took it 1.5 s.

So a schema (or all the tools one forced ``tool_choice`` allows, which share one grammar) may hold at most
MAX_DIGIT_STATES estimated digit states and MAX_REPEATS repetitions; past either, the create is a 400 naming the
largest contributor. The generator stops a grammar past MAX_GRAMMAR_BYTES whatever this estimate said
(generator.engines.schema_grammar), so a wrong estimate costs a refused stream, never a stalled worker.
"""

from __future__ import annotations

from typing import Any

from broker.errors import InvalidRequest, Path
from broker.schema.kinds import integer_bounds, kind, multiple_of, number_bounds, pattern_of, resolve_ref
from broker.schema.pattern import Alt, Node, Repeat, Seq

MAX_DIGIT_STATES = 20_000
MAX_REPEATS = 100_000
#: The generator's own bound on a grammar's text, whatever the estimate said.
MAX_GRAMMAR_BYTES = 4 * 1024 * 1024
#: The longest integer the automaton writes without a bound that says more (generator.engines.number_grammar).
FREE_DIGITS = 16


class GrammarSize:
    """The estimated size of one grammar, added up over the schemas it enforces (``add``); ``check`` raises
    InvalidRequest past a bound."""

    def __init__(self, label: str = "the schema") -> None:
        self.label = label  # what its grammar enforces, for the message
        self.digit_states: dict[tuple[Any, ...], int] = {}
        self.repeats = 0
        self._largest: dict[str, tuple[int, Path]] = {"digits": (0, ()), "repeats": (0, ())}

    def add(self, schema: dict[str, Any], where: Path) -> None:
        seen: set[int] = set()
        todo: list[tuple[Any, Path]] = [(schema, where)]
        while todo:
            s, at = todo.pop()
            if not isinstance(s, dict) or id(s) in seen:
                continue
            seen.add(id(s))
            todo += self._visit(s, at, schema)

    def _visit(self, s: dict[str, Any], at: Path, root: dict[str, Any]) -> list[tuple[Any, Path]]:
        k = kind(s)
        if k == "ref":
            return [(resolve_ref(root, s["$ref"]), (*at, "$ref"))]
        if k == "anyOf":
            return [(a, (*at, "anyOf", i)) for i, a in enumerate(s["anyOf"])]
        if k in ("object", "allOf"):
            parts = [s] if k == "object" else [resolve_ref(root, p["$ref"]) if "$ref" in p else p for p in s["allOf"]]
            out = [(v, (*at, "properties", n)) for part in parts for n, v in part.get("properties", {}).items()]
            if isinstance(s.get("additionalProperties"), dict):
                out.append((s["additionalProperties"], (*at, "additionalProperties")))
            return out
        if k == "array":
            if "maxItems" in s or "minItems" in s:
                self._repeat(int(s.get("maxItems", s.get("minItems", 0))), (*at, "maxItems"))
            if "prefixItems" in s:
                return [(v, (*at, "prefixItems", i)) for i, v in enumerate(s["prefixItems"])]
            return [(s.get("items", True), (*at, "items"))]
        if k == "string":
            node = pattern_of(s, at)
            if node is not None:
                self._pattern(node, (*at, "pattern"))
            elif "maxLength" in s or "minLength" in s:
                self._repeat(int(s.get("maxLength", s.get("minLength", 0))), (*at, "maxLength"))
        elif k in ("integer", "number") and set(s) & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                                     "multipleOf"}:
            self._number(s, k, at)
        return []

    def _number(self, s: dict[str, Any], k: str, at: Path) -> None:
        step = multiple_of(s)
        integral = step is not None and step == step.to_integral_value()
        if k == "integer" or integral:
            lo, hi = integer_bounds(s)
            n = int(step) if integral and step is not None else 1
        else:  # a number: its integer part as an integer of step 1, its fraction compared digit by digit
            nlo, _, nhi, _ = number_bounds(s)
            lo, hi = (None if nlo is None else int(nlo)), (None if nhi is None else int(nhi))
            n = 1
        lo_digits = len(str(abs(lo))) if lo is not None else 0
        hi_digits = len(str(abs(hi))) if hi is not None else 0
        top = max(FREE_DIGITS, lo_digits, hi_digits)
        before = sum(self.digit_states.values())
        self.digit_states[("free", n, top)] = 2 * top * n
        if lo is not None:
            self.digit_states[("lo", lo, n)] = lo_digits * n
        if hi is not None:
            self.digit_states[("hi", hi, n)] = hi_digits * n
        self._note("digits", sum(self.digit_states.values()) - before, at)

    def _pattern(self, node: Node, at: Path) -> None:
        todo = [node]
        while todo:
            n = todo.pop()
            if isinstance(n, Repeat):
                if (n.hi is not None and n.hi > 1) or n.lo > 1:
                    self._repeat(n.hi if n.hi is not None else n.lo, at)
                todo.append(n.node)
            elif isinstance(n, Seq):
                todo += n.items
            elif isinstance(n, Alt):
                todo += n.options

    def _repeat(self, count: int, at: Path) -> None:
        self.repeats += count
        self._note("repeats", count, at)

    def _note(self, part: str, cost: int, at: Path) -> None:
        if cost > self._largest[part][0]:
            self._largest[part] = (cost, at)

    def check(self) -> None:
        """Raise InvalidRequest, at the largest contributor, when the grammar would pass a bound."""
        states = sum(self.digit_states.values())
        if states > MAX_DIGIT_STATES:
            cost, at = self._largest["digits"]
            raise InvalidRequest.at(
                at, f": the bounded numbers (minimum, maximum, multipleOf) of {self.label} need a grammar of about "
                f"{states} digit states ({cost} for this one, the largest); at most {MAX_DIGIT_STATES} are accepted "
                "(fewer distinct bounds or multipleOf values, or a smaller multipleOf)")
        if self.repeats > MAX_REPEATS:
            cost, at = self._largest["repeats"]
            raise InvalidRequest.at(
                at, f": the repetitions (maxLength, maxItems, a pattern's counts) of {self.label} add up to "
                f"{self.repeats} ({cost} for this one, the largest); at most {MAX_REPEATS} are accepted")
