"""consumer.edge.errors: each of rsb's error codes has exactly one HTTP status, said in one place."""

from __future__ import annotations

import broker.errors
from broker.errors import RsbError
from consumer.edge.errors import STATUS


def test_every_error_code_has_one_status_and_no_status_is_for_a_code_nobody_raises() -> None:
    declared = {obj for obj in vars(broker.errors).values() if isinstance(obj, type) and issubclass(obj, RsbError)}
    codes = {cls.code for cls in declared}
    assert codes == set(STATUS), (codes ^ set(STATUS))
    assert not any(hasattr(cls, "status_code") for cls in declared)  # statuses live at the HTTP edge only
    assert STATUS["too_many_connections"] == 429 and STATUS["overloaded"] == 503
