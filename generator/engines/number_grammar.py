"""Grammars of bounded integers and numbers (JSON Schema's ``minimum``, ``maximum``, ``exclusive*``,
``multipleOf``), digit by digit.

An integer's digits are generated against its bounds as a deterministic automaton: a state knows which digits of
the lower and upper bound it still equals (``tight``), how many digits may still come, and the remainder modulo
``multipleOf`` so far; digits that lead to the same state share one character class, so the grammar's stacks stay
few. Lengths between the bounds' share one variable-length state. Numbers are written without an exponent: an
integer part, then (maybe) a fraction whose digits are compared with the bounds' fractions the same way. So the
answer satisfies the bounds exactly: no check after the fact, and no value the bounds exclude is ever written.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Context, Decimal, localcontext

from broker.schema.enforceable import EXACT_DIGITS, FRACTION_DIGITS

AddRule = Callable[[str, str], str]  # (name hint, body) -> rule name
_EPS = ""
#: Integers and the integer part of numbers: at most this many digits unless a bound needs more.
MAX_DIGITS = 16
MAX_FRACTION_DIGITS = FRACTION_DIGITS


def _classes(by_next: dict[str, list[int]]) -> list[str]:
    """``[0-4] next | [7] next2``: digits grouped by the state they lead to, in runs."""
    out = []
    for nxt, digits in by_next.items():
        runs: list[tuple[int, int]] = []
        for d in sorted(digits):
            if runs and runs[-1][1] == d - 1:
                runs[-1] = (runs[-1][0], d)
            else:
                runs.append((d, d))
        cls = "[" + "".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + "]"
        out.append(cls if nxt == _EPS else f"{cls} {nxt}")
    return out


class _Digits:
    """The rules of one integer magnitude automaton (shared by the lengths and signs of one schema)."""

    def __init__(self, add_rule: AddRule, step: int) -> None:
        self.add_rule = add_rule
        self.step = step
        self.memo: dict[tuple[str | None, str | None, int, int, int, bool], str | None] = {}

    def state(self, tl: str | None, th: str | None, rmin: int, rmax: int, rem: int, first: bool) -> str | None:
        """A rule for the rest: digits >= ``tl`` while tight with it, <= ``th`` likewise, ``rmin`` to ``rmax`` of
        them, ending with a remainder of 0. None: no such rest."""
        key = (tl, th, rmin, rmax, rem, first)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = None  # a state never reaches itself (rmax falls)
        end = rmin == 0 and rem == 0
        by_next: dict[str, list[int]] = {}
        if rmax > 0:
            lo = int(tl[0]) if tl else (1 if first else 0)
            hi = int(th[0]) if th else 9
            for d in range(lo, hi + 1):
                ntl = tl[1:] if tl and d == int(tl[0]) else None
                nth = th[1:] if th and d == int(th[0]) else None
                nxt = self.state(ntl, nth, max(rmin - 1, 0), rmax - 1, (rem * 10 + d) % self.step, False)
                if nxt is not None:
                    by_next.setdefault(nxt, []).append(d)
        if not by_next:
            result: str | None = _EPS if end else None
        else:
            body = " | ".join(_classes(by_next))
            result = self.add_rule("int", f"( {body} )?" if end else body)
        self.memo[key] = result
        return result

    def magnitude(self, lo: int, hi: int | None) -> list[str]:
        """Alternatives spelling the multiples of ``step`` from ``lo`` (>= 0) to ``hi`` (None: up to
        MAX_DIGITS digits, or the lower bound's), without leading zeros."""
        out: list[str] = []
        if lo == 0:
            out.append('"0"')
            lo = 1
        if hi is not None and hi < lo:
            return out
        lo_s = str(lo)
        top = max(MAX_DIGITS, len(lo_s)) if hi is None else len(str(hi))
        hi_s = None if hi is None else str(hi)
        starts: list[str | None] = []
        if len(lo_s) == top:
            starts.append(self.state(lo_s, hi_s, top, top, 0, True))
        else:
            starts.append(self.state(lo_s, None, len(lo_s), len(lo_s), 0, True))
            if hi_s is None:
                starts.append(self.state(None, None, len(lo_s) + 1, top, 0, True))
            else:
                if top - 1 >= len(lo_s) + 1:
                    starts.append(self.state(None, None, len(lo_s) + 1, top - 1, 0, True))
                starts.append(self.state(None, hi_s, top, top, 0, True))
        out += [s for s in starts if s]
        return out


def integer_rule(add_rule: AddRule, lo: int | None, hi: int | None, step: int = 1) -> str:
    """The body of a rule for the integers in [lo, hi] (None: unbounded) that are multiples of ``step``."""
    digits = _Digits(add_rule, step)
    alts: list[str] = []
    if lo is None or lo < 0:  # negative ones: "-" then a magnitude of at least 1
        mags = digits.magnitude(max(1, -hi) if hi is not None and hi < 0 else 1, None if lo is None else -lo)
        if mags:
            alts.append('"-" ( ' + " | ".join(mags) + " )")
    if hi is None or hi >= 0:
        alts += digits.magnitude(max(0, lo) if lo is not None else 0, hi)
    assert alts, "the bounds were checked to admit an integer"
    return "( " + " | ".join(alts) + " ) space"


def _split(x: Decimal) -> tuple[int, str]:
    """The integer part and the fraction's digits (no trailing zeros) of ``x`` >= 0."""
    whole = int(x)
    with localcontext(Context(prec=EXACT_DIGITS)):
        frac = format(x - whole, "f").partition(".")[2].rstrip("0")
    return whole, frac


class _Fraction:
    """The optional fraction after an integer part: digits compared with a lower fraction (``tl``, then tight),
    an upper one (``th``), exclusive flags, at most ``r`` digits."""

    def __init__(self, add_rule: AddRule) -> None:
        self.add_rule = add_rule
        self.memo: dict[tuple[str | None, str | None, bool, bool, int], str | None] = {}

    def can_end(self, tl: str | None, th: str | None, lo_x: bool, hi_x: bool) -> bool:
        above = tl is None or (tl == "" and not lo_x)
        below = th is None or th != "" or not hi_x
        return above and below

    def digits(self, tl: str | None, th: str | None, lo_x: bool, hi_x: bool, r: int) -> str | None:
        """A rule for one or more further digits (at most ``r``), the value staying within the bounds."""
        key = (tl, th, lo_x, hi_x, r)
        if key in self.memo:
            return self.memo[key]
        by_next: dict[str, list[int]] = {}
        for d in range(10):
            if tl:
                if d < int(tl[0]):
                    continue
                ntl = tl[1:] if d == int(tl[0]) else None
            else:
                ntl = None if tl is None or d > 0 else ""
            if th:
                if d > int(th[0]):
                    continue
                nth = th[1:] if d == int(th[0]) else None
            elif th == "":
                if d > 0:
                    continue
                nth = ""
            else:
                nth = None
            rest = self.digits(ntl, nth, lo_x, hi_x, r - 1) if r > 1 else None
            end = self.can_end(ntl, nth, lo_x, hi_x)
            if rest is None and not end:
                continue
            nxt = _EPS if rest is None else (f"{rest}?" if end else rest)
            by_next.setdefault(nxt, []).append(d)
        result = self.add_rule("frac", " | ".join(_classes(by_next))) if by_next else None
        self.memo[key] = result
        return result

    def part(self, tl: str | None, th: str | None, lo_x: bool, hi_x: bool, r: int) -> str | None:
        """What follows the integer part: nothing, or "." and digits; None: nothing fits."""
        more = self.digits(tl, th, lo_x, hi_x, r) if r > 0 else None
        end = self.can_end(tl, th, lo_x, hi_x)
        if more is None:
            return _EPS if end else None
        return f'( "." {more} )?' if end else f'"." {more}'


def _magnitude(add_rule: AddRule, lo: Decimal, lo_x: bool, hi: Decimal | None, hi_x: bool, r: int) -> list[str]:
    """Alternatives for the numbers from ``lo`` >= 0 to ``hi``, at most ``r`` fraction digits."""
    frac = _Fraction(add_rule)
    ints = _Digits(add_rule, 1)
    a_i, a_f = _split(lo)
    out: list[str] = []
    if hi is not None:
        b_i, b_f = _split(hi)
        if a_i == b_i:
            tail = frac.part(a_f, b_f, lo_x, hi_x, r)
            return [] if tail is None else [f'"{a_i}" {tail}'.strip()]
    tail = frac.part(a_f, None, lo_x, False, r)
    if tail is not None:
        out.append(f'"{a_i}" {tail}'.strip())
    middle = ints.magnitude(a_i + 1, None if hi is None else b_i - 1)
    if middle:
        any_tail = frac.part(None, None, False, False, r)
        out.append(f'( {" | ".join(middle)} ) {any_tail}'.strip())
    if hi is not None:
        tail = frac.part(None, b_f, False, hi_x, r)
        if tail is not None:
            out.append(f'"{b_i}" {tail}'.strip())
    return out


def number_rule(add_rule: AddRule, lo: Decimal | None, lo_x: bool, hi: Decimal | None, hi_x: bool,
                fraction_digits: int = MAX_FRACTION_DIGITS) -> str:
    """The body of a rule for the numbers within the bounds, written without an exponent."""
    zero = Decimal(0)
    alts: list[str] = []
    if lo is None or lo < 0:  # negative ones: "-" then a magnitude above 0
        m_lo, m_lo_x = (zero, True) if hi is None or hi >= 0 else (-hi, hi_x)
        mags = _magnitude(add_rule, m_lo, m_lo_x, None if lo is None else -lo, lo_x, fraction_digits)
        if mags:
            alts.append('"-" ( ' + " | ".join(mags) + " )")
    if hi is None or hi > 0 or (hi == 0 and not hi_x):
        p_lo, p_lo_x = (zero, False) if lo is None or lo < 0 else (lo, lo_x)
        alts += _magnitude(add_rule, p_lo, p_lo_x, hi, hi_x, fraction_digits)
    assert alts, "the bounds were checked to admit a number"
    return "( " + " | ".join(alts) + " ) space"
