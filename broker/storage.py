"""Redis refusing writes for lack of memory, as one process sees it: the *episode* (from the first refused write
to the first write that succeeds again), so that a pause of any length makes one log line when it starts and one
when it ends, never one per retry, and its refusals are counted for the metrics.

Pure bookkeeping (no Redis): a Redis error that is "out of memory" is a broker.errors.StoreFull (mapped in
broker.redis.connection); the generator's retries (generator.retry) and the consumer's error
boundary (consumer.edge.errors) report to an ``OutOfMemoryEpisodes`` each, and so does a background loop's round
(``one_round``: the one place that says what Redis away, Redis full and a bug do to a loop that goes on).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from broker.errors import StoreFull, StoreUnavailable

#: When Redis says it is full: a client's Retry-After, and the longest a worker waits between two tries.
STORAGE_FULL_RETRY_AFTER_S = 5
#: The consumer sees no "it worked again" signal of its own: refusals further apart than this are two episodes.
EPISODE_GAP_S = 30.0


class OutOfMemoryEpisodes:
    """Refused writes of one process, grouped into episodes. ``on_refused`` runs for every refusal (a metric)."""

    def __init__(self, log: logging.Logger, role: str, on_refused: Callable[[], None] | None = None,
                 gap_s: float = EPISODE_GAP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.role = role
        self.on_refused = on_refused
        self.gap_s = gap_s
        self.clock = clock
        self._started_at: float | None = None
        self._last_at = 0.0
        self._in_episode = 0  # refusals of the current episode

    @property
    def active(self) -> bool:
        return self._started_at is not None

    def refused(self, what: str) -> None:
        """A write was refused for lack of memory (``what``: which one, for the log line; never a prompt)."""
        now = self.clock()
        if self._started_at is not None and now - self._last_at > self.gap_s:
            self._end(self._last_at)  # quiet for longer than a gap: that episode ended unseen
        self._last_at = now
        if self.on_refused is not None:
            self.on_refused()
        if self._started_at is None:
            self._started_at = now
            self._in_episode = 0
            self.log.warning("redis is out of memory (maxmemory): writes are refused, %s waits and retries; "
                             "free memory or raise maxmemory", self.role,
                             extra={"storage_full": "start", "first_refused": what})
        self._in_episode += 1

    def recovered(self) -> None:
        """A write succeeded: an episode in progress ends here."""
        if self._started_at is not None:
            self._end(self.clock())

    def _end(self, at: float) -> None:
        assert self._started_at is not None
        self.log.info("redis accepts writes again after %.1f s out of memory (%d writes refused and retried)",
                      at - self._started_at, self._in_episode,
                      extra={"storage_full": "end", "paused_s": round(at - self._started_at, 3),
                             "refused": self._in_episode})
        self._started_at = None


@contextlib.contextmanager
def one_round(log: logging.Logger, what: str, full: OutOfMemoryEpisodes) -> Iterator[None]:
    """One round of a loop that runs for the process's life and tries again next round (touching the streams being
    read, taking and recording webhook events, answering token counts): Redis away is a warning, Redis full a refusal
    of ``full``'s episode, anything else a bug, logged with its traceback; none of them ends the loop."""
    try:
        yield
    except StoreUnavailable as e:
        log.warning("%s: redis unavailable, tried again: %s", what, e)
    except StoreFull:
        full.refused(what)
    except Exception as e:
        log.error("%s failed: %s", what, type(e).__name__, exc_info=e)
