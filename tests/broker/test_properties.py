"""Property tests (hypothesis): the SSE encoder, the resume-id parser and the request validator hold for
any input, including CR, LF, NUL, U+2028 and lone surrogates."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.errors import InvalidRequest
from broker.events import Event, EventPage, EventType, encode_data, parse_event_id
from broker.request.generation import GenerationRequest, RequestLimits, parse_create_body

NASTY = st.sampled_from(["\r", "\n", "\r\n", "\x00", "\u2028", "\u2029", "\ud800", "\udfff", "\ufeff", "data: x",
                         "\n\nid: 9-9\n", ":", "🌍", "你好", "\\", '"'])
TEXT = st.lists(st.one_of(st.text(), NASTY), max_size=8).map("".join)
# Ids Redis may issue: any pair of u64s but the largest, which no XADD * reaches and nothing can follow (a resume
# point after it is refused: broker.events.parse_event_id).
IDS = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)).filter(
    lambda t: t != (2**64 - 1, 2**64 - 1)).map(lambda t: f"{t[0]}-{t[1]}")


def _parse_frames(raw: bytes) -> list[dict[str, str]]:
    """A strict SSE parser (the WHATWG algorithm's line splitting): CR, LF and CRLF all end lines."""
    text = raw.decode("utf-8")
    events: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if fields:
                events.append(fields)
            fields = {}
            continue
        name, _, value = line.partition(":")
        fields[name] = value[1:] if value.startswith(" ") else value
    return events


@pytest.mark.slow  # hundreds of examples: seconds
@given(st.lists(st.tuples(IDS, st.sampled_from(list(EventType)), TEXT), max_size=20), st.booleans())
@settings(max_examples=200)
def test_a_page_frames_exactly_as_its_events_do(rows: list[tuple[str, str, str]], parsed: bool) -> None:
    """EventPage frames a raw XRANGE reply in one pass; a reply parsed into dicts (a client made elsewhere)
    goes through the Events: both are byte for byte what each Event sends, and indexing or slicing gives
    the same Events."""
    stored = [(eid.encode(), etype.encode(), encode_data({"text": text})) for eid, etype, text in rows]
    entries = [(eid, {b"t": t, b"d": d}) if parsed else [eid, [b"t", t, b"d", d]] for eid, t, d in stored]
    page = EventPage(entries)
    events = [Event(eid.decode(), t.decode(), d) for eid, t, d in stored]
    assert page.frames() == b"".join(ev.to_sse() for ev in events)
    assert list(page) == events and len(page) == len(events)
    if events:
        assert page[-1] == events[-1] and list(page[1:]) == events[1:]


@pytest.mark.slow  # hundreds of examples: seconds
@given(TEXT, IDS)
@settings(max_examples=300)
def test_any_delta_text_is_exactly_one_well_framed_event(text: str, eid: str) -> None:
    frame = Event(eid, EventType.DELTA, encode_data({"text": text})).to_sse()
    assert frame.endswith(b"\n\n") and frame.count(b"\n\n") == 1
    assert b"\r" not in frame and b"\x00" not in frame
    events = _parse_frames(frame)
    assert len(events) == 1 and set(events[0]) == {"id", "event", "data"}
    assert events[0]["id"] == eid and events[0]["event"] == "delta"
    decoded = orjson.loads(events[0]["data"])["text"]
    expected = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    assert decoded == expected


@given(IDS)
def test_issued_ids_parse_and_order_like_redis(eid: str) -> None:
    ms, seq = map(int, eid.split("-"))
    assert parse_event_id(eid) == (ms, seq)


@pytest.mark.slow  # hundreds of examples: seconds
@given(st.text(max_size=50))
@settings(max_examples=500)
def test_the_resume_id_parser_accepts_only_ids(raw: str) -> None:
    parsed = parse_event_id(raw)
    if parsed is not None:
        # Exactly two decimal numbers joined by "-" (leading zeros aside), nothing else.
        assert f"{parsed[0]}-{parsed[1]}" == "-".join(p.lstrip("0") or "0" for p in raw.split("-"))
        assert "\n" not in raw and "\r" not in raw and " " not in raw
        assert all(0 <= p < 2**64 for p in parsed)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
                    max_leaves=12)
BODY_KEYS = st.sampled_from(["id", "messages", "prompt", "model", "max_tokens", "temperature", "top_p", "seed",
                             "stop", "cancel_on_disconnect", "extra"])


@pytest.mark.slow  # hundreds of examples: seconds
@given(st.dictionaries(BODY_KEYS, JSON, max_size=6) | JSON)
@settings(max_examples=400)
def test_the_request_validator_accepts_or_raises_invalid_request_only(body: object) -> None:
    try:
        raw = orjson.dumps(body)
    except TypeError:  # lone surrogates cannot be JSON: the server sees them as invalid bytes
        raw = repr(body).encode("utf-8", "surrogatepass")
    try:
        _, req = parse_create_body(raw, RequestLimits(max_tokens=4096, default_max_tokens=16))
    except InvalidRequest as e:
        assert e.message
        return
    assert isinstance(req, GenerationRequest)
    assert (req.messages is None) != (req.prompt is None)
    assert 1 <= req.max_tokens <= 4096
    assert GenerationRequest.from_canonical(req.canonical_json()) == req
