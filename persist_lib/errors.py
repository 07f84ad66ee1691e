"""The error taxonomy of persist (docs/design.md section 14).

Two axes: *usage* errors (the call can never succeed as made: fix the call) versus
*location* errors (Blob/Consensus misbehaved), and for location errors whether the
operation definitely did not happen (``Determinate``) or may have happened
(``Indeterminate``). ``UpperMismatch`` is not a failure of persist but the ordinary
"you lost the race" answer of ``compare_and_append``. ``CorruptionError`` means a blob
failed its checksum: nothing is returned in that case.

Every message names the shard, the values involved and what to do. The two roots,
``PersistError`` and ``InvalidUsage``, are defined in ``error_base`` (below
``frontier``, which raises ``InvalidUsage``) and listed here with the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from persist_lib.error_base import InvalidUsage, PersistError
from persist_lib.frontier import Antichain

__all__ = [
    "BlobNotFound",
    "ConfigProblem",
    "CorruptionError",
    "Determinate",
    "ExternalError",
    "Indeterminate",
    "InvalidBlobKey",
    "InvalidUri",
    "IncompatibleSchemaChange",
    "InvalidConfig",
    "InvalidUsage",
    "InvalidUtf8",
    "InvalidUtf8InPart",
    "LeaseExpired",
    "LocationNotFound",
    "PersistError",
    "SchemaMismatch",
    "ShardTombstoned",
    "SincePassed",
    "StaleSchema",
    "StateFormatTooNew",
    "Timeout",
    "UpperMismatch",
    "describe",
]


class SchemaMismatch(InvalidUsage):
    """A shard was opened with schemas other than the ones recorded in its state."""


class StaleSchema(SchemaMismatch):
    """A shard's (or collection's) schemas evolved past the version a handle was opened
    with: a writer under an older version is refused (nothing written), and a reader
    meets parts of a version it does not know. Reopen the handle with the current
    schemas (``persist schema show``). ``current_version`` is the version now in force."""

    def __init__(self, message: str, *, current_version: int | None = None) -> None:
        self.current_version = current_version
        super().__init__(message)


class IncompatibleSchemaChange(InvalidUsage):
    """A schema change that can't be made in place (a key column changed, a type
    narrowed or changed kind, a new column not nullable, a reordered or re-used column):
    nothing was changed. Build a new rendition with the new schemas instead (rebuild it
    from the raw collection, then hand over to it)."""


class LeaseExpired(InvalidUsage):
    """The handle's lease lapsed and maintenance expired it: open a new handle."""


class ShardTombstoned(InvalidUsage):
    """The shard was finalized (its since and upper are empty): it can't be opened."""


class SincePassed(InvalidUsage):
    """A read without a registered reader (``PersistClient.snapshot``) asked for a time
    before the shard's since, or the since moved past it while the read ran and the parts
    it needed were compacted away and collected: history before the since is no longer
    kept. Read as of a time at or after the since, or hold the since with a leased reader
    (``open_leased_reader``) or a critical since handle while reading old times."""


class InvalidUri(InvalidUsage):
    """A Blob or Consensus URI could not be understood."""


class InvalidBlobKey(InvalidUsage):
    """A blob key does not follow the key grammar (or would escape the blob root)."""


class LocationNotFound(InvalidUsage):
    """A command that only reads was pointed at a location that does not exist (it never
    creates one): point it at the right one (``PERSIST_HOME``, ``--blob``/``--consensus``)."""


class StateFormatTooNew(InvalidUsage):
    """Shard state written by a newer major state format: upgrade persist_lib."""


class InvalidUtf8(InvalidUsage):
    """A string column of an update holds bytes that are not valid UTF-8: nothing was
    written. ``column`` is the field name, ``row`` the row of the updates as passed."""

    def __init__(self, shard: str, column: str, row: int, detail: str) -> None:
        self.shard = shard
        self.column = column
        self.row = row
        super().__init__(
            f"shard {shard}: column {column!r} row {row} is not valid UTF-8 ({detail}); nothing "
            "was written. Decode the source bytes with their real encoding, drop or repair the "
            "row, or declare the field as binary if it holds arbitrary bytes"
        )


class ConfigProblem(NamedTuple):
    """One bad setting of a configuration: the field, the value it was given, what is
    allowed and how to fix it. ``source`` is how the user spelled the setting when it is
    not the field itself (``--timeout``, ``$PERSIST_METRICS_PORT``)."""

    field: str
    value: Any
    allowed: str
    fix: str
    source: str | None = None

    def describe(self) -> str:
        where = self.field if self.source is None else f"{self.source} (field {self.field})"
        return f"{where} = {self.value!r}: {self.allowed}; {self.fix}"


class InvalidConfig(InvalidUsage):
    """A configuration (``PersistConfig``) was given bad settings: nothing was built
    with them. ``problems`` lists every bad setting at once (the field, the bad value,
    what is allowed, how to fix it). Also a ``ValueError``."""

    def __init__(self, problems: Sequence[ConfigProblem], *, what: str = "PersistConfig") -> None:
        if not problems:
            raise ValueError("InvalidConfig needs at least one problem")
        self.problems = tuple(problems)
        self.what = what
        n = len(self.problems)
        lines = "; ".join(f"({i}) {p.describe()}" for i, p in enumerate(self.problems, 1))
        super().__init__(f"invalid {what}: {n} bad setting{'s' if n > 1 else ''}: {lines}")

    def with_sources(
        self, sources: Mapping[str, str], *, what: str | None = None, fixes: Mapping[str, str] | None = None
    ) -> InvalidConfig:
        """The same problems, each field named in ``sources`` reported as the setting the
        user gave (a command-line option, a resource field) instead of the field, with
        its fix from ``fixes`` when given there (the option's own default, say)."""
        fixes = fixes or {}
        renamed = [
            p._replace(source=sources[p.field], fix=fixes.get(p.field, p.fix)) if p.field in sources else p
            for p in self.problems
        ]
        return type(self)(renamed, what=what or self.what)  # the same (sub)class


class UpperMismatch(PersistError):
    """``compare_and_append`` lost: the shard upper is not the expected one.

    ``current`` carries the shard's actual upper so the caller can decide what to do.
    """

    def __init__(self, shard: str, expected: Antichain, current: Antichain) -> None:
        self.shard = shard
        self.expected = expected
        self.current = current
        super().__init__(
            f"shard {shard}: upper mismatch: expected upper {expected} but the shard upper is "
            f"{current}; re-read the upper and retry from {current} (or give up if another "
            "writer already wrote the data)"
        )


class ExternalError(PersistError):
    """A Blob or Consensus operation failed."""


class Determinate(ExternalError):
    """The operation definitely did not happen: it is safe to retry."""


class Indeterminate(ExternalError):
    """The operation may or may not have happened: retry only idempotent operations."""


class BlobNotFound(Determinate):
    """A blob that the state references is not in the blob store."""


class CorruptionError(PersistError):
    """A blob failed its checksum or could not be decoded: stop; nothing wrong is returned."""


class InvalidUtf8InPart(CorruptionError):
    """A part (checksum intact) holds a string that is not valid UTF-8: it was written by
    a persist_lib without the write-time UTF-8 check. Nothing is returned from it."""

    def __init__(self, shard: str, part: str, column: str, row: int, detail: str) -> None:
        self.shard = shard
        self.part = part
        self.column = column
        self.row = row
        super().__init__(
            f"shard {shard}: part {part}: column {column!r} row {row} is not valid UTF-8 "
            f"({detail}); the part was written by a persist_lib version that did not check "
            "strings on write, and its data can't be read as text; nothing was returned. Way "
            "out: rebuild the collection in a new rendition from its raw collection "
            "(persist_lib.ingest.rebuild.rebuild_rendition; the invalid records then go to the "
            "errors collection as invalid_utf8) and hand over to it, or rewrite the data from "
            "its source into a new shard (docs/ingestion.md, 'Invalid UTF-8')"
        )


class Timeout(PersistError):
    """A wait (for an upper to advance, for a location to answer) ran out of time."""


def describe(value: Any) -> str:
    """Renders a value for an error message (frontiers print as ``[t]`` / ``[]``)."""
    return str(value)
