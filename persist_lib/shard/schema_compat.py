"""Which schema changes a shard can make in place (docs/design.md, "Schema evolution").

A shard's data stays readable across a change when every part written under an
earlier version can be turned into the new version's layout by a cheap, exact, local
transformation of its decoded table (``shard.migrate``), and the turned table keeps
persist's invariants (rows sorted by ``(k, v, t)`` within a sorted part, keys equal
where they were equal). That holds for exactly these changes of the *value* fields:

* **add** a nullable field (anywhere): old rows read it as null;
* **widen** a field's type: ``int8 < int16 < int32 < int64``, ``uint8 < ... < uint64``,
  an unsigned type into a wider signed one, ``float16 < float32 < float64``, a decimal's
  precision up at the same scale (decimal128 into decimal256 too), ``string`` into
  ``large_string``, ``binary`` into ``large_binary``; a ``not null`` field may become
  nullable. Each is an order-preserving, lossless cast;
* **drop** a field: old rows lose it (and rows that become equal are consolidated).

Everything else is refused with ``IncompatibleSchemaChange`` and nothing changes: any
change of the key fields (they decide where a row lives and what consolidates), a
narrowing or a change of kind, a new field that is not nullable (old rows have no
value for it), value fields that change their relative order (sorted parts would no
longer be sorted), and re-using the name of a field an earlier version had (fields are
matched by name, so an old part's values would come back under the new field).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from persist_lib.errors import IncompatibleSchemaChange
from persist_lib.shard.codec import Schemas

REBUILD_HINT = (
    "nothing was changed. This change can't be made in place: build a new rendition with "
    "the new schemas (ctl.create_rendition(name, rendition, n, key_schema=..., "
    "val_schema=...), rebuild it from the raw collection, then ctl.handover to it)"
)

_INT_ORDER = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]
_UINT_ORDER = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
_FLOAT_ORDER = [pa.float16(), pa.float32(), pa.float64()]


@dataclass(frozen=True)
class SchemaChange:
    """One change of a value field between two versions: ``kind`` is ``add``, ``widen``,
    ``nullable`` (not null -> nullable) or ``drop``."""

    kind: str
    field: str
    old_type: str | None
    new_type: str | None

    def describe(self) -> str:
        if self.kind == "add":
            return f"add {self.field}: {self.new_type}"
        if self.kind == "drop":
            return f"drop {self.field} ({self.old_type})"
        if self.kind == "nullable":
            return f"make {self.field} nullable"
        return f"widen {self.field}: {self.old_type} -> {self.new_type}"


def is_widening(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether every ``old`` value is exactly a ``new`` value, in the same order."""
    if old.equals(new):
        return True
    for order in (_INT_ORDER, _UINT_ORDER, _FLOAT_ORDER):
        if old in order and new in order:
            return order.index(new) > order.index(old)
    if old in _UINT_ORDER and new in _INT_ORDER:
        return new.bit_width > old.bit_width
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        if old.scale != new.scale or new.precision < old.precision:
            return False
        return new.bit_width >= old.bit_width
    if pa.types.is_string(old) and pa.types.is_large_string(new):
        return True
    return pa.types.is_binary(old) and pa.types.is_large_binary(new)


def _refuse(shard: str, what: str) -> IncompatibleSchemaChange:
    return IncompatibleSchemaChange(f"{shard}: {what}; {REBUILD_HINT}")


def check_evolution(current: Schemas, new: Schemas, *, shard: str) -> list[SchemaChange]:
    """The changes from ``current`` (with its history) to ``new``; raises
    ``IncompatibleSchemaChange`` for anything that can't be made in place. An empty
    list: ``new`` is ``current``."""
    if _sig(current.key) != _sig(new.key):
        raise _refuse(
            shard,
            f"the key fields can't change (key({_fields(current.key)}) -> key({_fields(new.key)}))",
        )
    old_fields = {f.name: f for f in current.val}
    earlier = {f.name for v in current.history for f in list(v.key) + list(v.val)}
    earlier |= set(current.key_names)
    changes: list[SchemaChange] = []
    kept: list[str] = []
    for f in new.val:
        o = old_fields.get(f.name)
        if o is None:
            if f.name in earlier:
                raise _refuse(
                    shard,
                    f"field {f.name!r} existed in an earlier version and was dropped; its old "
                    "values would come back under the new field. Use another name",
                )
            if not f.nullable:
                raise _refuse(
                    shard,
                    f"new field {f.name!r} must be nullable (rows written before it have no "
                    "value for it)",
                )
            changes.append(SchemaChange("add", f.name, None, str(f.type)))
            continue
        kept.append(f.name)
        if not is_widening(o.type, f.type):
            raise _refuse(
                shard,
                f"field {f.name!r} can't change from {o.type} to {f.type} in place (only "
                "widening: int8/16/32 -> int64, float32 -> float64, decimal precision up at "
                "the same scale, string -> large_string, binary -> large_binary)",
            )
        if o.nullable and not f.nullable:
            raise _refuse(shard, f"field {f.name!r} can't become not null (old rows may hold nulls)")
        if not o.type.equals(f.type):
            changes.append(SchemaChange("widen", f.name, str(o.type), str(f.type)))
        elif not o.nullable and f.nullable:
            changes.append(SchemaChange("nullable", f.name, str(o.type), str(f.type)))
    order = [f.name for f in current.val if f.name in set(kept)]
    if order != kept:
        raise _refuse(shard, f"value fields can't be reordered ({order} -> {kept})")
    new_names = set(new.val_names)
    for f in current.val:
        if f.name not in new_names:
            changes.append(SchemaChange("drop", f.name, str(f.type), None))
    return changes


def _sig(s: pa.Schema) -> list[tuple[str, str, bool]]:
    return [(f.name, str(f.type), f.nullable) for f in s]


def _fields(s: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" + ("" if f.nullable else " not null") for f in s)
