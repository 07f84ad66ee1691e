"""``PersistIOManager``: stores any asset's output in a persist collection.

The asset key names the collection (``a/b/c`` -> ``a.b.c``: the key prefix is the
namespace); the output's key columns come from ``persist/key``, every other column is
the value. Each write is one transaction at a new time ``t`` (wall-clock milliseconds,
never below the collection's or the ledger's upper) holding the data's updates and the
write's ledger entry, conditional on both uppers (``atomic_commit``); a write that lost
the race against a concurrent one recomputes its updates against the new contents and
tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import dagster as dg
import numpy as np
import pyarrow as pa

from dagster_project.io_manager import lazy_read, lineage, spark_read, spark_write, write_modes
from dagster_project.io_manager.atomic_commit import commit_with_ledger, logical_upper
from dagster_project.io_manager.collection_setup import ensure_collection
from dagster_project.io_manager.errors import (
    AsOfNotReadable,
    IOManagerConfigError,
    NoRecordedMaterialization,
    OutputSchemaMismatch,
)
from dagster_project.io_manager.factory_config import IO_MANAGER_RULES, check_io_manager_settings
from dagster_project.io_manager.ledger import LandedWrite, WriteLedger, entry, now_ms
from dagster_project.io_manager.partitions import PartitionSelection
from dagster_project.io_manager.schema_follow import conform_output
from dagster_project.io_manager.settings import InputSettings, OutputSettings
from dagster_project.io_manager.type_handlers import (
    from_arrow,
    is_lazy_type,
    is_spark_type,
    to_arrow,
)
from dagster_project.resources import PersistResource
from persist_lib.errors import UpperMismatch
from persist_lib.frontier import Antichain
from persist_lib.shard.codec import Schemas
from persist_lib.storage import StorageController
from persist_lib.storage.reader import CollectionReader
from persist_lib.storage.writer import CollectionWriter

MAX_ATTEMPTS = 64


def collection_name(key: dg.AssetKey, prefix: str = "") -> str:
    return ".".join([*([prefix] if prefix else []), *key.path])


def _selection(context: dg.OutputContext | dg.InputContext, columns: dict[str, str], where: str) -> PartitionSelection | None:
    if not context.has_asset_partitions:
        if columns:
            raise IOManagerConfigError(f"{where}: persist/partition_column is set but the asset is not partitioned")
        return None
    if not columns:
        raise IOManagerConfigError(
            f"{where}: the asset is partitioned: add metadata {{'persist/partition_column': <column>}} "
            "naming the column its partition key maps to"
        )
    pdef = context.asset_partitions_def
    keys = list(context.asset_partition_keys)
    if isinstance(pdef, dg.MultiPartitionsDefinition):
        dims = [d.name for d in pdef.partitions_defs]
        if set(dims) != set(columns):
            raise IOManagerConfigError(
                f"{where}: persist/partition_column must map every dimension {dims} to a column, got {columns}"
            )
        by_dim = [dict(pdef.get_partition_key_from_str(str(k)).keys_by_dimension) for k in keys]
        return PartitionSelection(columns, by_dim)
    if set(columns) != {""}:
        raise IOManagerConfigError(f"{where}: a one-dimensional asset takes one partition column name, got {columns}")
    window = None
    if isinstance(pdef, dg.TimeWindowPartitionsDefinition):
        tw = context.asset_partitions_time_window
        window = (tw.start, tw.end)
    return PartitionSelection(columns, [{"": k} for k in keys], window)


def _column_types(schemas: Schemas) -> dict[str, pa.DataType]:
    return {f.name: f.type for f in [*schemas.key, *schemas.val]}


class PersistIOManagerImpl(dg.IOManager):
    def __init__(
        self, persist: PersistResource, default_mode: str, num_shards: int, prefix: str, ledger: str,
        read_memory_budget: int | None = None,
    ) -> None:
        self.persist = persist
        self.read_memory_budget = read_memory_budget
        self.default_mode = default_mode
        self.num_shards = num_shards
        self.prefix = prefix
        self.ledger_name = ledger
        self._reads: dict[str, dict[str, int]] = {}  # step key -> {input collection: time read}
        # Called between computing a write's updates and committing them (tests interleave a
        # concurrent write there, deterministically).
        self.before_commit: Callable[[], None] | None = None

    # ----- output --------------------------------------------------------------------

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if obj is None:
            return
        key = context.asset_key
        where = f"asset {key.to_user_string()}"
        settings = OutputSettings.parse(
            context.definition_metadata or {}, where, default_mode=self.default_mode, default_shards=self.num_shards
        )
        # A PySpark output stays on the executors (``spark_write``): its schema as Arrow
        # stands in for the table in the checks.
        df = obj if spark_write.is_spark_output(obj) else None
        if df is not None:
            table, handler = spark_write.arrow_schema(df).empty_table(), "pyspark"
        else:
            table, handler = to_arrow(obj, where)
        sel = _selection(context, settings.partition_columns, where)
        new, key_schema, val_schema = self._split(table, settings, where)
        if sel is not None:
            if df is not None:  # checked and written from one materialization
                df = df.localCheckpoint(eager=True)
                spark_write.check_owns(df, sel, where)
            else:
                sel.check_owns(new, where)
        name = collection_name(key, self.prefix)
        parts = sel.describe() if sel is not None else None
        write_id = "/".join([context.run_id, context.step_key, key.to_user_string(), parts or ""])
        ctl = self.persist.controller()
        self._ensure_collection(ctl, name, key_schema, val_schema, settings.num_shards, where)
        if df is not None and not self._atomic(ctl, name):
            context.log.info(
                f"{where}: collection {name!r} or the ledger {self.ledger_name!r} is not transactional: "
                "the PySpark output is collected to the driver (Arrow) and written from there"
            )
            new = self._split(to_arrow(df, where)[0], settings, where)[0]
            df = None
        elif df is not None:
            new = spark_write.relax_nullability(ctl, name, new)
        conformed = conform_output(ctl, name, new, settings.key, settings.delete_column, settings.schema_change, where)
        new = conformed.table
        if conformed.evolved is not None:
            context.log.info(
                f"{where}: collection {name!r} evolved to schema version {conformed.evolved['version']} "
                f"({'; '.join(conformed.evolved.get('changes') or []) or conformed.evolved['outcome']})"
            )
        if conformed.filled:
            context.log.info(f"{where}: columns {conformed.filled} are not in the output: written as nulls")
        if df is not None:
            landed, counts, replayed = spark_write.store(
                ctl, WriteLedger(ctl, self.ledger_name), name, spark_write.conform(df, conformed), settings, sel,
                where, write_id, lambda w: self._check_schemas(w, new, settings, name, where), self.before_commit,
            )
        else:
            landed, counts, replayed = self.store(ctl, name, new, settings, sel, where, write_id)
        if replayed:
            context.log.info(f"{where}: write {write_id} already landed at {landed.time}; not written again")
        reads = self._reads.pop(context.step_key, {})
        meta = lineage.output_metadata(
            name, landed.time, landed.upper, settings.mode, counts, write_id, handler, parts, reads, replayed
        )
        if conformed.evolved is not None:
            meta["persist/schema_version"] = conformed.evolved["version"]
        context.add_output_metadata(meta)
        context.step_context.set_data_version(key, lineage.data_version(landed.time))

    def _split(self, table: pa.Table, s: OutputSettings, where: str) -> tuple[pa.Table, pa.Schema, pa.Schema]:
        missing = [c for c in [*s.key, *([s.delete_column] if s.delete_column else [])] if c not in table.column_names]
        if missing:
            raise IOManagerConfigError(f"{where}: columns {missing} (persist/key, persist/delete_column) are not in the output {table.column_names}")
        vals = [c for c in table.column_names if c not in s.key and c != s.delete_column]
        ordered = table.select([*s.key, *vals, *([s.delete_column] if s.delete_column else [])])
        schema = ordered.schema
        return ordered, pa.schema([schema.field(c) for c in s.key]), pa.schema([schema.field(c) for c in vals])

    def _atomic(self, ctl: StorageController, name: str) -> bool:
        """Whether a write of ``name`` and its ledger entry can be one transaction."""
        ledger = WriteLedger(ctl, self.ledger_name)
        ledger.ensure()
        return ctl.is_transactional(name) and ctl.is_transactional(ledger.name)

    def _ensure_collection(self, ctl: StorageController, name: str, key: pa.Schema, val: pa.Schema, shards: int, where: str) -> None:
        """Creates the collection unless it exists (its schemas are checked by ``store``,
        on the writer it opens anyway)."""
        ensure_collection(ctl, name, key, val, shards, transactional=True)

    @staticmethod
    def _check_schemas(w: CollectionWriter, new: pa.Table, s: OutputSettings, name: str, where: str) -> None:
        schema = new.schema
        key = pa.schema([schema.field(c) for c in s.key])
        val = pa.schema([f for f in schema if f.name not in s.key and f.name != s.delete_column])
        if w.schemas != Schemas.create(key, val):
            raise OutputSchemaMismatch(
                f"{where}: output schemas {Schemas.create(key, val).describe()} differ from collection "
                f"{name!r}'s {w.schemas.describe()}; return the recorded columns and types, or materialize into a new asset key"
            )

    def store(
        self, ctl: StorageController, name: str, new: pa.Table, s: OutputSettings,
        sel: PartitionSelection | None, where: str, write_id: str,
    ) -> tuple[LandedWrite, dict[str, int], bool]:
        """Writes ``new`` (key and value columns) into existing collection ``name`` unless
        the ledger holds ``write_id`` already. Returns where it landed, its counts and
        whether it had landed before (then nothing was written).

        Writes its ledger entry in the same transaction when both collections are
        transactional (``atomic_commit``), else after the data's compare-and-append (the
        old collections' two-commit path, see ``ledger``). The handles are opened once for
        the schema check, the ledger lookup and the write."""
        ledger = WriteLedger(ctl, self.ledger_name)
        atomic = self._atomic(ctl, name)
        with ExitStack() as stack:
            w = stack.enter_context(ctl.open_writer(name))
            self._check_schemas(w, new, s, name, where)
            lw = stack.enter_context(ctl.open_writer(ledger.name)) if atomic else None
            landed = ledger.lookup(name, write_id, writer=lw)
            if landed is not None:
                return landed, {"rows": new.num_rows}, True
            r = stack.enter_context(ctl.acquire_read_handle(name))
            landed, changes = self._write(ctl, name, new, s, sel, where, ledger, write_id, w, r, lw)
        return landed, {"rows": new.num_rows, **changes}, False

    def _write(
        self, ctl: StorageController, name: str, new: pa.Table, s: OutputSettings,
        sel: PartitionSelection | None, where: str, ledger: WriteLedger, write_id: str,
        w: CollectionWriter, r: CollectionReader, lw: CollectionWriter | None,
    ) -> tuple[LandedWrite, dict[str, int]]:
        """The write's attempts: its updates against the contents at the collection's
        upper, committed (with the ledger's entry through ``lw``, when given) unless
        either collection moved meanwhile, recomputed when the data's did."""
        atomic = lw is not None
        upper = -1
        updates = new
        for attempt in range(1, MAX_ATTEMPTS + 1):
            u = logical_upper(w) if atomic else w.upper.time
            assert u is not None
            if u != upper:  # the contents moved (or the first attempt): recompute
                upper = u
                updates = self._updates(w, r, new, s, sel, upper, where)
            t = max(upper, now_ms())
            lower_l = 0
            if lw is not None:
                lu = logical_upper(lw)
                lower_l, t = lu, max(t, lu)
            landed = LandedWrite(t, t + 1)
            timed = updates.append_column("ts", pa.array(np.full(updates.num_rows, t, dtype=np.int64)))
            timed = timed.select([*w.schemas.key_names, *w.schemas.val_names, "ts", "diff"])
            if self.before_commit is not None:
                self.before_commit()
            try:
                if lw is not None:
                    commit_with_ledger(ctl, w, timed, upper, lw, entry(name, write_id, landed, t), lower_l, t + 1)
                else:
                    w.compare_and_append(timed, upper, t + 1)
            except UpperMismatch:
                continue  # the data or the ledger moved: nothing was written
            if lw is None:
                ledger.record(name, write_id, landed)  # a second commit: the crash window
            diffs = np.asarray(timed.column("diff"))
            return landed, {
                "inserted": int(diffs[diffs > 0].sum()),
                "retracted": -int(diffs[diffs < 0].sum()),
                "attempts": attempt,
            }
        raise UpperMismatch(name, Antichain([upper]), w.upper)

    def _updates(
        self, w: CollectionWriter, r: CollectionReader, new: pa.Table, s: OutputSettings,
        sel: PartitionSelection | None, upper: int, where: str,
    ) -> pa.Table:
        """The updates (with ``diff``) that turn the contents as of ``upper - 1`` into the output."""
        if s.mode == "append":
            return write_modes.append(new)
        if upper > 0:
            filt = sel.pushdown(_column_types(w.schemas), where) if sel is not None and s.mode == "overwrite" else None
            old = write_modes.expand(r.snapshot_batches(upper - 1, filter=filt).read_all())
        else:
            old = new.slice(0, 0).select(w.schemas.key_names + w.schemas.val_names)
        if s.mode == "overwrite":
            if sel is not None:
                old = old.filter(sel.mask(old, where))
            return write_modes.overwrite(old, new, s.key)
        return write_modes.upsert(old, new, s.key, s.delete_column)

    # ----- input ---------------------------------------------------------------------

    def load_input(self, context: dg.InputContext) -> Any:
        key = context.asset_key
        where = f"input {context.name!r} (asset {key.to_user_string()})"
        settings = InputSettings.parse(context.definition_metadata, where)
        up_md = context.upstream_output.definition_metadata if context.upstream_output else {}
        pcols = OutputSettings.parse(
            {**(up_md or {}), "persist/key": (up_md or {}).get("persist/key", ["_"])}, where,
            default_mode=self.default_mode, default_shards=self.num_shards,
        ).partition_columns
        sel = _selection(context, pcols, where)
        name = collection_name(key, self.prefix)
        ctl = self.persist.controller()
        typ = context.dagster_type.typing_type
        with ctl.acquire_read_handle(name) as r:
            as_of = self._as_of(context, settings, sel, r.upper.time, name, where)
            types = _column_types(r.schemas)
            filt = sel.pushdown(types, where) if sel is not None else None
            cols = None
            if settings.columns is not None:
                bad = [c for c in settings.columns if c not in types]
                if bad:
                    raise IOManagerConfigError(f"{where}: columns {bad} are not columns of {name!r} ({list(types)})")
                cols = list(dict.fromkeys([*settings.columns, *(sel.columns.values() if sel is not None else [])]))
            # only the parts that can hold the partitions' rows are fetched; only the
            # asked-for columns (and the partition columns) are returned
            if is_spark_type(typ):  # fetched and decoded on the executors
                value = spark_read.load_dataframe(
                    spark_read.active_session(), r, as_of, columns=cols, filter=filt, sel=sel,
                    keep=settings.columns, where=where,
                )
            elif is_lazy_type(typ):  # read when collected, streamed within the budget
                value = lazy_read.lazy_frame(
                    lambda: self.persist.controller().acquire_read_handle(name), r.schemas, as_of,
                    filter=filt, sel=sel, keep=settings.columns, memory_budget=self.read_memory_budget, where=where,
                )
            else:
                table = write_modes.expand(r.snapshot_batches(as_of, columns=cols, filter=filt).read_all())
                if sel is not None:
                    table = table.filter(sel.mask(table, where))
                if settings.columns is not None:
                    table = table.select(settings.columns)
                value = from_arrow(table, typ, where)
        if context.has_asset_key and context.step_context is not None:
            self._reads.setdefault(context.step_context.step.key, {})[name] = as_of
        if sel is None or len(sel.keys) == 1:  # Dagster attaches input metadata to one partition
            context.add_input_metadata({"persist/as_of": dg.MetadataValue.int(as_of), lineage.COLLECTION: name})
        return value

    def _as_of(
        self, context: dg.InputContext, s: InputSettings, sel: PartitionSelection | None, upper: int | None,
        name: str, where: str,
    ) -> int:
        """The time an input reads. ``upper``: its collection's (None: closed, every time readable)."""
        if isinstance(s.as_of, int):
            if upper is not None and s.as_of >= upper:
                raise AsOfNotReadable(
                    f"{where}: persist/as_of {s.as_of} is not readable yet: collection {name!r}'s upper is {upper} "
                    f"(times below it are complete); ask for a time below {upper}, or 'latest' / 'recorded'"
                )
            return s.as_of
        partitions = [k for k in context.asset_partition_keys] if sel is not None else None
        if s.run_id is not None:
            return lineage.time_as_of_run(context.instance, s.run_id, context.asset_key, partitions, where)
        if s.as_of == "latest":
            if not upper:
                raise NoRecordedMaterialization(f"{where}: the collection has no data yet; materialize the upstream first")
            return upper - 1
        instance = context.instance
        produced_by = context.upstream_output.run_id if context.upstream_output is not None else None
        if produced_by:
            for rid in lineage.run_lineage(instance, produced_by):
                t = lineage.time_in_run(instance, rid, context.asset_key, partitions)
                if t is not None:
                    return t
        t = lineage.latest_recorded_time(instance, context.asset_key, partitions)
        if t is None:
            raise NoRecordedMaterialization(
                f"{where}: no materialization of the upstream records a persist time; materialize it "
                "through PersistIOManager first, or read with input metadata {'persist/as_of': 'latest'}"
            )
        return t


class PersistIOManager(dg.ConfigurableIOManagerFactory):
    """Stores asset outputs in persist collections (see ``docs/dagster.md``).

    ``default_mode``: the write mode of assets that set no ``persist/mode``;
    ``num_shards``: shards of the collections it creates (default 1; any number up to
    1024: the collections are transactional, so a write to all shards and its ledger
    entry is one atomic commit); ``prefix``: a namespace put before every asset key; ``ledger``: the
    collection that records which writes landed (retried steps never write twice);
    ``read_memory_budget``: what a LazyFrame input's streaming read decodes at most at once
    (default: persist's ``read_memory_budget``).
    """

    persist: PersistResource
    default_mode: str = "overwrite"
    num_shards: int = 1
    prefix: str = ""
    ledger: str = "dagster_io.writes"
    read_memory_budget: int | None = None

    def create_io_manager(self, context: dg.InitResourceContext) -> PersistIOManagerImpl:
        check_io_manager_settings({f: getattr(self, f) for f in IO_MANAGER_RULES})  # all bad settings at once
        return PersistIOManagerImpl(
            self.persist, self.default_mode, self.num_shards, self.prefix, self.ledger, self.read_memory_budget
        )

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.persist.close()  # the controller's holds and the client (reopened on next use)
