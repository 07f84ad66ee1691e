"""Evolving a shard's schemas through a client (``PersistClient.compare_and_evolve_schema``).

The transition and its rules are ``shard.schema_registry`` and ``shard.schema_compat``;
this runs it through the shard's machine: one compare-and-set that checks and records
the change together, re-run against fresh state if another change landed first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from persist_lib.errors import InvalidUsage, SchemaMismatch
from persist_lib.shard.codec import Schemas
from persist_lib.shard.schema_registry import EvolveResult, compare_and_evolve

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.shard.machine import Machine


def evolve_shard_schemas(machine: Machine, expected: Schemas, new: Schemas) -> EvolveResult:
    """Moves the shard's schemas from ``expected`` to ``new`` in one CAS (see
    ``compare_and_evolve``); a shard that does not exist is an ``InvalidUsage``."""
    if not machine.fetch_latest().exists:  # (a rare call: always against the latest state)
        raise InvalidUsage(
            f"shard {machine.shard_id} does not exist; evolving schemas never creates one"
        )
    res, _ = machine.apply(
        "compare_and_evolve_schema",
        lambda s, now: compare_and_evolve(s, now, expected=expected, new=new),
    )
    return res


R = TypeVar("R")


def retry_fresh(machine: Machine, fn: Callable[[], R]) -> R:
    """``fn()`` (a transition that checks schemas), once more against the latest state
    when it raised ``SchemaMismatch`` on a cached one: another process may have evolved
    the shard's schemas since this process cached its state."""
    try:
        return fn()
    except SchemaMismatch:
        machine.fetch_latest()
        return fn()
