"""Schema changes written as text: ``COL:TYPE`` for added and widened value columns,
``COL`` for dropped ones (what ``persist schema evolve`` and the Dagster
``evolve_schema_job`` take).

Only the parsing lives here; whether a change can be made in place is decided by
``shard/schema_compat.py`` when the change is applied (``StorageController.evolve_schema``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pyarrow as pa

from persist_lib.errors import InvalidUsage

TYPES_HELP = (
    "TYPE is an Arrow type name: int8/16/32/64, uint8/16/32/64, float16/32/64 (float, "
    "double), string, large_string, binary, large_binary, bool, date32, "
    "timestamp[s|ms|us|ns], decimal128(P,S) (or decimal(P,S)), decimal256(P,S)"
)
_DECIMAL = re.compile(r"^decimal(128|256)?\((\d+),\s*(\d+)\)$")


class BadColumnSpec(InvalidUsage):
    """An added, widened or dropped column given as text that can't be understood."""


def parse_type(text: str, what: str) -> pa.DataType:
    """An Arrow type from its name (``TYPES_HELP``); ``what`` names the argument in errors."""
    t = text.strip()
    m = _DECIMAL.match(t)
    if m:
        p, s = int(m.group(2)), int(m.group(3))
        return pa.decimal256(p, s) if m.group(1) == "256" else pa.decimal128(p, s)
    try:
        return pa.type_for_alias(t)
    except (ValueError, KeyError) as e:
        raise BadColumnSpec(f"{what}: unknown type {t!r}; {TYPES_HELP}") from e


def _col_type(spec: str, flag: str) -> tuple[str, pa.DataType]:
    name, sep, typ = spec.partition(":")
    if not sep or not name.strip() or not typ.strip():
        raise BadColumnSpec(f"{flag} {spec!r}: expected COLUMN:TYPE, e.g. {flag} price:float64")
    return name.strip(), parse_type(typ, f"{flag} {spec!r}")


def evolved_val(
    val: pa.Schema,
    *,
    add: Sequence[str] = (),
    widen: Sequence[str] = (),
    drop: Sequence[str] = (),
) -> pa.Schema:
    """The value schema after dropping ``drop``, widening ``widen`` and adding ``add`` (in
    that order); ``BadColumnSpec`` names the first argument that does not fit ``val``."""
    fields = list(val)
    names = [f.name for f in fields]
    for d in drop:
        if d not in names:
            raise BadColumnSpec(f"--drop {d!r}: no such value column (value columns: {names})")
        fields = [f for f in fields if f.name != d]
        names.remove(d)
    for spec in widen:
        name, typ = _col_type(spec, "--widen")
        if name not in names:
            raise BadColumnSpec(f"--widen {spec!r}: no such value column (value columns: {names})")
        fields = [pa.field(f.name, typ, f.nullable, f.metadata) if f.name == name else f for f in fields]
    for spec in add:
        name, typ = _col_type(spec, "--add")
        if name in names:
            raise BadColumnSpec(f"--add {spec!r}: a value column {name!r} exists already")
        fields.append(pa.field(name, typ, nullable=True))
        names.append(name)
    return pa.schema(fields)
