"""rsb's keyspace on Redis: the prefix of every key and the hash tags of its partitions.

Every key of one partition shares the partition's hash tag, so each atomic script stays inside one hash slot and
the schema runs unchanged on Redis Cluster, while the partitions spread the data over every master.
``partitions`` is part of the stored data's address: choose it once per deployment.

The hash tag of partition ``i`` of ``N`` is chosen so that the N tags' hash slots are spread evenly over
the 16384 slots: tag ``p<i>`` when its slot already falls in the middle half of the i-th N-th of the slot
space, else the first ``p<i>-<k>`` that does. Plain ``p0``..``pN-1`` would not do: CRC16 clusters them
(p0, p1 and p2 all land on the first two masters of a 3-master cluster). Redis Cluster (``redis-cli
--cluster create``, and managed offerings) gives each master a contiguous, equal share of the slots, so
evenly spaced slots put ``N / masters`` partitions on every master. Keeping each slot within the middle
half of its N-th leaves room for the boundaries to be off by a few slots. With ``N = 1`` the tag is
``p0``, whatever its slot. The mapping is a pure function of (i, N): every process agrees on it.

The key names themselves are broker.streams.keys's (rsb's streams, jobs and chats) and broker.durable.keys's
(Durable Streams).
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

PREFIX = "rsb"


def partition_share(limit: int, partitions: int) -> int:
    """What one partition allows of a caller's ``limit`` (0: no limit), when its counter lives in each partition's slot
    so that a script checks it in the one step that counts it: ceil(limit / partitions), exact with one partition (the
    default); with more, a caller whose work crowds one partition meets its share there a little before the whole."""
    return -(-limit // partitions) if limit > 0 else 0


@functools.cache
def partition_tag(partition: int, partitions: int) -> str:
    """The hash tag (without braces) of partition ``partition`` of ``partitions``; see the module doc."""
    if not 0 <= partition < max(1, partitions):
        raise ValueError(f"partition {partition} out of range for {partitions} partitions")
    if partitions <= 1:
        return "p0"
    width = REDIS_CLUSTER_HASH_SLOTS / partitions
    lo, hi = partition * width + width / 4, (partition + 1) * width - width / 4
    candidate, k = f"p{partition}", 0
    # Each try lands in the window with probability 1/(2N): a few dozen CRC16s at most, once per process.
    while not lo <= key_slot(candidate.encode()) < hi:
        k += 1
        candidate = f"p{partition}-{k}"
    return candidate


def partition_slot(partition: int, partitions: int) -> int:
    """The Redis Cluster hash slot of every key of this partition."""
    return key_slot(partition_tag(partition, partitions).encode())


def tagged(partition: int, partitions: int) -> str:
    """``rsb:{<tag>}``: what every key of the partition starts with."""
    return f"{PREFIX}:{{{partition_tag(partition, partitions)}}}"


#: What a named part of a key may hold, as the key-schema test matches it (any other part: some text).
PART_PATTERNS = {
    "tag": re.escape(PREFIX) + r":\{[^{}]+\}",
    "sid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "day": r"-?\d+",
    "digest": r"[0-9a-f]{32}",  # a conversation's or a Durable Stream's name, hashed (SHA-256, 128 bits in hex)
}


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """One kind of key: literal text and named parts (``"{qp}w:{tier}:{who}"``). Python builds a key with ``build``; a
    script that names the key inside Lua, from a prefix it holds (a queue's ``qp``, stored in a stream's meta), gets
    its builder from ``lua``, generated from the same text, so the two languages cannot spell a key differently; the
    key-schema test (tests/broker/test_key_schema.py) matches every key Redis holds against ``pattern``. A part that
    is itself the beginning of a key names that key's template in ``within``."""

    text: str
    within: tuple[tuple[str, KeyTemplate], ...] = ()

    @classmethod
    def under(cls, text: str, **within: KeyTemplate) -> KeyTemplate:
        return cls(text, tuple(within.items()))

    def __post_init__(self) -> None:
        for literal, _ in self.pieces:
            if any(c in literal for c in "'\\\n{}"):
                raise ValueError(f"a key template's literal text is plain: {self.text!r}")

    @property
    def pieces(self) -> list[tuple[str, str | None]]:
        """(literal, part name or None) pairs, in order."""
        return [(literal, name) for literal, name, _, _ in string.Formatter().parse(self.text)]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(name for _, name in self.pieces if name is not None)

    @property
    def literals(self) -> tuple[str, ...]:
        """The literal text between the parts (what a Lua script must not spell itself)."""
        return tuple(literal for literal, _ in self.pieces if literal)

    def build(self, **parts: str) -> str:
        if parts.keys() != set(self.parts):
            raise TypeError(f"key {self.text!r} has parts {self.parts}, given {sorted(parts)}")
        return self.text.format(**parts)

    def lua(self, function: str) -> str:
        """``local function <function>(<parts>) return <the key> end``: the Lua builder of this kind of key."""
        terms = []
        for literal, name in self.pieces:
            if literal:
                terms.append(f"'{literal}'")
            if name is not None:
                terms.append(name)
        return f"local function {function}({', '.join(self.parts)}) return {' .. '.join(terms)} end\n"

    @property
    def pattern(self) -> str:
        """A regular expression every key of this kind matches whole."""
        within = dict(self.within)
        out = []
        for literal, name in self.pieces:
            out.append(re.escape(literal))
            if name is not None:
                out.append(f"(?:{within[name].pattern})" if name in within else PART_PATTERNS.get(name, ".+?"))
        return "".join(out)


def lua_builders(**builders: KeyTemplate) -> str:
    """Lua functions, one per ``name=template``, each building that kind of key from its parts (for a script that
    names keys inside Lua)."""
    return "".join(template.lua(name) for name, template in builders.items())


#: A key no script ever writes (a SETRANGE of nothing leaves none), beside ``key`` in its slot
#: (broker.redis.connection.REFUSE_WHEN_FULL).
NEVER_WRITTEN = KeyTemplate("{key}:oom")
