"""A shard's schema registry and its one state change, ``compare_and_evolve``.

The registry is the shard state's ``schemas`` entry: the current key/value schemas and,
once they evolved, ``versions`` (every earlier version, oldest first; version ids are
positions, the current one is ``len(versions)``). Parts record the fingerprint of the
version they were written under; readers migrate them (``shard.migrate``).

``compare_and_evolve(state, expected, new)`` is one pure transition, so the check and
the change commit in one compare-and-set (the ``Machine`` re-runs it on a lost CAS):

* the shard's current schemas are not ``expected``: nothing changes, ``MISMATCH`` with
  the current version (someone evolved first: re-read and decide again);
* they already are ``new``: ``ALREADY`` (a retry after an indeterminate CAS, or a
  collection evolve resumed after a crash: idempotent);
* ``new`` is not an in-place change of them (``schema_compat.check_evolution``):
  ``IncompatibleSchemaChange``, nothing changes;
* else the new state's schemas are ``new`` with the old current appended to ``versions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from persist_lib.errors import InvalidUsage, ShardTombstoned
from persist_lib.shard.codec import Schemas
from persist_lib.shard.schema_compat import SchemaChange, check_evolution
from persist_lib.shard.state import ShardState


class EvolveOutcome(Enum):
    APPLIED = "applied"
    ALREADY = "already"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class EvolveResult:
    outcome: EvolveOutcome
    version: int  # the shard's current version after the call
    schemas: Schemas  # the shard's current schemas after the call (with their history)
    changes: tuple[SchemaChange, ...] = ()


def recorded_schemas(state: ShardState) -> Schemas:
    """The shard's current schemas with their earlier versions."""
    if state.schemas is None:
        raise InvalidUsage(f"shard {state.shard_id} does not exist (it has no schemas yet)")
    return Schemas.from_json(state.schemas)


def with_history(state: ShardState, schemas: Schemas) -> Schemas:
    """``schemas`` as the shard records them (with the earlier versions a reader needs to
    migrate old parts) when they are its current schemas, else ``schemas`` as given."""
    if state.schemas is None:
        return schemas
    recorded = Schemas.from_json(state.schemas)
    return recorded if recorded == schemas else schemas


def compare_and_evolve(
    state: ShardState, now_ms: int, *, expected: Schemas, new: Schemas
) -> tuple[ShardState | None, EvolveResult]:
    """The transition described in the module docstring."""
    if state.tombstone:
        raise ShardTombstoned(f"shard {state.shard_id} is a tombstone: its schemas can't change")
    current = recorded_schemas(state)
    if current == new:
        return None, EvolveResult(EvolveOutcome.ALREADY, current.version, current)
    if current != expected:
        return None, EvolveResult(EvolveOutcome.MISMATCH, current.version, current)
    changes = check_evolution(current, new, shard=f"shard {state.shard_id}")
    evolved = Schemas(new.key, new.val, (*current.history, Schemas(current.key, current.val)))
    return state.evolve(schemas=evolved.to_json()), EvolveResult(
        EvolveOutcome.APPLIED, evolved.version, evolved, tuple(changes)
    )
