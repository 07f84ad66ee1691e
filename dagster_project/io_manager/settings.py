"""What an asset's metadata asks of the I/O manager: ``persist/*`` keys, checked at once.

Output (asset definition) metadata:

* ``persist/key``: the key columns (a list of column names; required);
* ``persist/mode``: ``overwrite`` (default), ``append`` or ``upsert``;
* ``persist/delete_column``: for ``upsert``, a boolean column whose true rows delete
  their key (the column itself is not stored);
* ``persist/partition_column``: the column a partitioned asset's partition key maps to
  (a dict ``{dimension: column}`` for multi-partitions);
* ``persist/num_shards``: shards of a new collection (default: the I/O manager's);
* ``persist/schema_change``: ``evolve`` (default: an output with new value columns or
  wider types evolves the collection in place, ``schema_follow.py``) or ``fail``.

Input metadata: ``persist/as_of`` (``recorded``, the default: the time the upstream
materialization recorded; ``latest``; an integer persist time; or the id of a run that
materialized the upstream, read as of the time that materialization recorded) and
``columns``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dagster_project.io_manager.errors import IOManagerConfigError

MODES = ("overwrite", "append", "upsert")
SCHEMA_CHANGES = ("evolve", "fail")
AS_OF_MODES = ("recorded", "latest")


def check_mode(mode: object, where: str) -> str:
    if mode not in MODES:
        raise IOManagerConfigError(
            f"{where}: unknown write mode {mode!r}; use one of {', '.join(MODES)}"
        )
    return str(mode)


def _str_list(value: object, what: str, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise IOManagerConfigError(f"{where}: {what} must be a column name or a non-empty list of them, got {value!r}")


def _meta_value(value: Any) -> Any:
    """A metadata entry's plain value (Dagster wraps some in ``MetadataValue``s)."""
    return getattr(value, "value", value)


@dataclass(frozen=True)
class OutputSettings:
    key: list[str]
    mode: str
    delete_column: str | None
    partition_columns: dict[str, str]  # dimension ("" for a one-dimensional asset) -> column
    num_shards: int
    schema_change: str = "evolve"

    @classmethod
    def parse(
        cls, metadata: Mapping[str, Any], where: str, *, default_mode: str, default_shards: int
    ) -> OutputSettings:
        md = {k: _meta_value(v) for k, v in metadata.items()}
        if "persist/key" not in md:
            raise IOManagerConfigError(
                f"{where}: no key columns: add metadata {{'persist/key': [<column>, ...]}} to the asset"
            )
        key = _str_list(md["persist/key"], "persist/key", where)
        mode = check_mode(md.get("persist/mode", default_mode), where)
        delete = md.get("persist/delete_column")
        if delete is not None and not isinstance(delete, str):
            raise IOManagerConfigError(f"{where}: persist/delete_column must be a column name, got {delete!r}")
        if delete is not None and mode != "upsert":
            raise IOManagerConfigError(
                f"{where}: persist/delete_column is only meaningful with persist/mode 'upsert' (mode is {mode!r})"
            )
        pc = md.get("persist/partition_column")
        if pc is None:
            parts: dict[str, str] = {}
        elif isinstance(pc, str):
            parts = {"": pc}
        elif isinstance(pc, Mapping) and pc and all(isinstance(v, str) for v in pc.values()):
            parts = {str(k): str(v) for k, v in pc.items()}
        else:
            raise IOManagerConfigError(
                f"{where}: persist/partition_column must be a column name or {{dimension: column}}, got {pc!r}"
            )
        shards = md.get("persist/num_shards", default_shards)
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 1024:
            raise IOManagerConfigError(f"{where}: persist/num_shards must be an int in [1, 1024], got {shards!r}")
        change = md.get("persist/schema_change", "evolve")
        if change not in SCHEMA_CHANGES:
            raise IOManagerConfigError(
                f"{where}: persist/schema_change must be one of {', '.join(SCHEMA_CHANGES)}, got {change!r}"
            )
        return cls(key, mode, delete, parts, shards, str(change))


@dataclass(frozen=True)
class InputSettings:
    as_of: str | int  # "recorded", "latest", a persist time or a run id (``run_id``)
    columns: list[str] | None

    @property
    def run_id(self) -> str | None:
        """The run whose materialization of the upstream the input is read as of."""
        return self.as_of if isinstance(self.as_of, str) and self.as_of not in AS_OF_MODES else None

    @classmethod
    def parse(cls, metadata: Mapping[str, Any] | None, where: str) -> InputSettings:
        md = {k: _meta_value(v) for k, v in (metadata or {}).items()}
        as_of = md.get("persist/as_of", "recorded")
        if isinstance(as_of, bool) or not (
            (isinstance(as_of, str) and as_of.strip()) or (isinstance(as_of, int) and as_of >= 0)
        ):
            raise IOManagerConfigError(
                f"{where}: persist/as_of must be 'recorded', 'latest', a persist time (an int >= 0) "
                f"or a run id, got {as_of!r}"
            )
        if isinstance(as_of, str):
            as_of = as_of.strip()
        cols = md.get("columns")
        columns = None if cols is None else _str_list(cols, "columns", where)
        return cls(as_of, columns)
