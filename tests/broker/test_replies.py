"""The scripts' replies read by name (broker.streams.replies): each shape a script answers, as Redis sends it
(bytes; None for a field the script left nil)."""

from __future__ import annotations

from broker.streams.replies import AppendReply, ClaimReply, CreateReply, TaggedReply


def test_a_create_reply_names_what_each_tag_carries() -> None:
    assert CreateReply.read([b"created"]) == CreateReply("created")
    assert CreateReply.read([b"exists", b"running"]).detail == "running"
    assert CreateReply.read([b"budget_exceeded", b"team", b"usd"]) == CreateReply("budget_exceeded", "team",
                                                                                   over="usd")
    limited = CreateReply.read([b"rate_limited", b"1500", b"", b"0"])
    assert limited == CreateReply("rate_limited", "1500", None, 0)  # no job finished yet: no estimate
    full = CreateReply.read([b"queue_full", b"7", b"2.5", b"3", b"wait"])
    assert (full.detail, full.ema_job_s, full.busy, full.bound) == ("7", 2.5, 3, "wait")


def test_an_append_reply_names_its_cancel_its_seq_or_its_last_id() -> None:
    assert AppendReply.read([b"appended", b"client", b"1-2"]) == AppendReply("appended", "client", last_id="1-2")
    assert AppendReply.read([b"seq", b"4"]) == AppendReply("seq", seq=4)
    assert AppendReply.read([b"fenced", b""]) == AppendReply("fenced")


def test_a_tagged_reply_has_at_most_one_value() -> None:
    assert TaggedReply.read([b"fenced"]) == TaggedReply("fenced", "")
    assert TaggedReply.read([b"renewed", b"disconnect"]).value == "disconnect"
    assert TaggedReply.read([b"empty", b""]).value == ""


def test_a_claim_reply_is_read_by_its_fields_names() -> None:
    raw = [b"claimed", b"sid", b"3", b"2", b"{}", b"", b"m", b"5", b"rsb:{p0}:t:alice", b"default", b"1.0", b"1.5",
           b""]
    r = ClaimReply(*raw)
    assert (r.fence, r.seq, r.tenant, r.claimed_at) == (b"3", b"5", b"rsb:{p0}:t:alice", b"1.5")
