"""Identifiers: shards, writers, readers, parts. Each is a prefixed UUID string.

The prefix makes ids self-describing in blob keys and error messages, and lets a
parser reject something that is not an id of the right kind with a clear message.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from persist_lib.errors import InvalidUsage

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@dataclass(frozen=True, order=True)
class _PrefixedId:
    value: str

    PREFIX = ""
    KIND = "id"

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not re.fullmatch(self.PREFIX + _UUID, self.value):
            raise InvalidUsage(
                f"{self.value!r} is not a valid {self.KIND}: expected '{self.PREFIX}' followed by "
                f"a lowercase UUID, e.g. {self.PREFIX}{uuid.UUID(int=0)}"
            )

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


class ShardId(_PrefixedId):
    PREFIX = "s"
    KIND = "shard id"

    @classmethod
    def new(cls) -> ShardId:
        return cls("s" + str(uuid.uuid4()))

    @classmethod
    def parse(cls, value: str | ShardId) -> ShardId:
        return value if isinstance(value, ShardId) else cls(value)


class WriterId(_PrefixedId):
    PREFIX = "w"
    KIND = "writer id"

    @classmethod
    def new(cls) -> WriterId:
        return cls("w" + str(uuid.uuid4()))


class ReaderId(_PrefixedId):
    PREFIX = "r"
    KIND = "reader id"

    @classmethod
    def new(cls) -> ReaderId:
        return cls("r" + str(uuid.uuid4()))


class CriticalReaderId(_PrefixedId):
    PREFIX = "c"
    KIND = "critical reader id"

    @classmethod
    def new(cls) -> CriticalReaderId:
        return cls("c" + str(uuid.uuid4()))


def new_uuid() -> str:
    return str(uuid.uuid4())
