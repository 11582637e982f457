"""The client's reading of ``Retry-After``: ASCII seconds or an HTTP date; anything else (other scripts' digits,
``inf``, ``nan``, a sign) is no hint, never a wait for ever."""

from __future__ import annotations

import pytest

from rsb._exceptions import parse_retry_after


@pytest.mark.parametrize(("value", "seconds"), [("2", 2.0), ("1.5", 1.5), (" 4 ", 4.0), ("inf", None), ("nan", None),
                                                ("١", None), ("²", None), ("-3", None), ("", None), (None, None),
                                                ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)])
def test_retry_after_is_ascii_seconds_or_a_date(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value) == seconds
