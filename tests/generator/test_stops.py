from __future__ import annotations

from generator.stops import StopFilter


def feed_all(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    f = StopFilter(stops)
    out = ""
    for p in pieces:
        out += f.feed(p)
        if f.stopped:
            return out, True
    return out + f.flush(), False


def test_stop_sequence_split_over_pieces_is_never_emitted() -> None:
    assert feed_all(("END",), ["abc E", "N", "D more"]) == ("abc ", True)


def test_partial_match_that_turns_out_not_to_be_a_stop_is_emitted_in_full() -> None:
    assert feed_all(("END",), ["abc EN", "x def"]) == ("abc ENx def", False)


def test_earliest_of_several_stop_sequences_wins() -> None:
    assert feed_all(("zz", "b"), ["a", "bzz"]) == ("a", True)


def test_no_stops_passes_everything_through() -> None:
    assert feed_all((), ["a", "b"]) == ("ab", False)


def test_the_filter_says_which_stop_sequence_ended_the_text() -> None:
    f = StopFilter(("END", "\n\n", "xy"))
    assert f.feed("one two\n") == "one two" and f.matched is None  # held: it may begin "\n\n"
    assert f.feed("\nEND") == "" and f.stopped and f.matched == "\n\n"  # the earliest in the text
    g = StopFilter(("abc", "ab"))
    assert g.feed("xxabc") == "xx" and g.matched == "abc"  # two at one place: the first given
