"""Data-quality checks on collection contents with Great Expectations 1.x.

There is no Dagster integration for GE 1.x (``dagster-ge`` needs ``great-expectations<1``),
so the check is written here: the collection's contents at its latest decided time
(``upper - 1``) are read through a STORAGE read handle and validated against a suite
built from ``CollectionRules`` in an *ephemeral* GE context (nothing is written to disk).
The checks are **blocking**: a failure fails the run and stops downstream assets.

**Bounded memory.** The contents are streamed (``CollectionReader.snapshot_batches``)
and validated chunk by chunk (a pandas frame of about ``memory_budget / 32`` bytes of
Arrow data each, one GE batch per chunk, one suite and context for all), and the
per-chunk results are added up: an expectation passes iff it passes on every chunk;
unexpected and element counts are sums; samples come from the first failing chunks.
Uniqueness needs all rows of a key in one chunk: the stream is sorted by key within a
shard and a key lives in one shard, so chunks are cut only between keys — when the
rules' key columns are the collection's key fields. Otherwise uniqueness is checked
within each chunk only (and the metadata says so).

Expectations:
- every key column (and each ``not_null`` column) is not null;
- each ``ranges`` column lies within its bounds;
- the accumulated diff of every record is positive (``>= 1``), i.e. the collection never
  holds a negative multiplicity (a retraction without its insertion);
- upsert collections (``unique_key``): each key appears at most once with diff exactly 1.
"""

import itertools
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from dagster_project.metadata import time_point
from dagster_project.resources import PersistResource
from persist_lib.cli.values import bytes_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")


@dataclass(frozen=True)
class CollectionRules:
    """What a collection's contents must satisfy (see the module docstring)."""

    key_columns: tuple[str, ...]
    not_null: tuple[str, ...] = ()
    ranges: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    unique_key: bool = False


MiB = 1 << 20
#: What one check run may hold: the streamed read gets half, a chunk's Arrow data 1/32
#: (its pandas frame and GE's working copies are several times that).
DEFAULT_MEMORY_BUDGET = 256 * MiB
SAMPLE = 5


@dataclass
class ValidationOutcome:
    """The result of a GE validation (over one or several chunks), as check metadata."""

    passed: bool
    rows: int
    statistics: dict[str, Any]
    failures: list[dict[str, Any]]
    chunks: int = 1
    notes: list[str] = field(default_factory=list)

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "rows": self.rows,
            "evaluated": int(self.statistics.get("evaluated_expectations", 0)),
            "successful": int(self.statistics.get("successful_expectations", 0)),
            "success_percent": float(self.statistics.get("success_percent") or 0.0),
            "failures": dg.MetadataValue.json(self.failures),
            "chunks": self.chunks,
        }
        if self.notes:
            meta["notes"] = dg.MetadataValue.json(self.notes)
        return meta


def _suite(rules: CollectionRules) -> Any:
    import great_expectations as gx

    ex = gx.expectations
    exps: list[Any] = []
    for col in dict.fromkeys((*rules.key_columns, *rules.not_null)):
        exps.append(ex.ExpectColumnValuesToNotBeNull(column=col))
    for col, (lo, hi) in rules.ranges.items():
        exps.append(ex.ExpectColumnValuesToBeBetween(column=col, min_value=lo, max_value=hi))
    exps.append(
        ex.ExpectColumnValuesToBeBetween(
            column="diff", min_value=1, max_value=1 if rules.unique_key else None
        )
    )
    if rules.unique_key:
        if len(rules.key_columns) == 1:
            exps.append(ex.ExpectColumnValuesToBeUnique(column=rules.key_columns[0]))
        else:
            exps.append(ex.ExpectCompoundColumnsToBeUnique(column_list=list(rules.key_columns)))
    return gx.ExpectationSuite(name="collection_contents", expectations=exps)


class _Validator:
    """One ephemeral GE context, pandas batch definition and suite, validating chunk
    after chunk and adding the results up per expectation."""

    def __init__(self, rules: CollectionRules) -> None:
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
        self._batch_def = (
            ctx.data_sources.add_pandas("collection")
            .add_dataframe_asset(name="contents")
            .add_batch_definition_whole_dataframe("latest")
        )
        self._suite = _suite(rules)
        self.rows = 0
        self.chunks = 0
        # per expectation (type + kwargs), in suite order
        self._acc: dict[str, dict[str, Any]] = {}

    def validate(self, df: "pd.DataFrame") -> None:
        res = self._batch_def.get_batch(batch_parameters={"dataframe": df}).validate(
            self._suite, result_format="SUMMARY"
        )
        self.rows += len(df)
        self.chunks += 1
        for r in res.results:
            cfg = r.expectation_config
            kwargs = {k: v for k, v in cfg.kwargs.items() if k != "batch_id"}
            ident = cfg.type + json.dumps(kwargs, sort_keys=True, default=str)
            a = self._acc.setdefault(
                ident,
                {"expectation": cfg.type, "kwargs": kwargs, "success": True,
                 "unexpected_count": None, "element_count": 0, "sample": []},
            )
            a["success"] = a["success"] and bool(r.success)
            result = r.result or {}
            a["element_count"] += int(result.get("element_count") or 0)
            if result.get("unexpected_count") is not None:
                a["unexpected_count"] = (a["unexpected_count"] or 0) + int(result["unexpected_count"])
            if not r.success and len(a["sample"]) < SAMPLE:
                room = SAMPLE - len(a["sample"])
                a["sample"] += [_plain(v) for v in (result.get("partial_unexpected_list") or [])[:room]]

    def outcome(self, notes: list[str] | None = None) -> ValidationOutcome:
        accs = list(self._acc.values())
        evaluated = len(accs)
        successful = sum(1 for a in accs if a["success"])
        failures = []
        for a in accs:
            if a["success"]:
                continue
            f = {
                "expectation": a["expectation"],
                "kwargs": a["kwargs"],
                "unexpected_count": a["unexpected_count"],
                "sample": a["sample"],
            }
            if self.chunks > 1:
                f["element_count"] = a["element_count"]
            failures.append(f)
        stats = {
            "evaluated_expectations": evaluated,
            "successful_expectations": successful,
            "unsuccessful_expectations": evaluated - successful,
            "success_percent": 100.0 * successful / evaluated if evaluated else None,
        }
        return ValidationOutcome(
            evaluated == successful, self.rows, stats, failures, self.chunks, list(notes or [])
        )


def validate_frame(df: "pd.DataFrame", rules: CollectionRules) -> ValidationOutcome:
    """Validates a collection snapshot (key/value columns, ``ts``, ``diff``) with GE."""
    return validate_frames([df], rules)


def validate_frames(
    frames: Iterable["pd.DataFrame"], rules: CollectionRules, notes: list[str] | None = None
) -> ValidationOutcome:
    """Validates the chunks of one snapshot with one suite and adds the results up (an
    expectation passes iff it passes on every chunk; counts add up). Uniqueness is
    checked within each chunk: the caller keeps each key's rows in one chunk."""
    v = _Validator(rules)
    for df in frames:
        v.validate(df)
    if v.chunks == 0:
        raise ValueError("validate_frames needs at least one frame (an empty one for no rows)")
    return v.outcome(notes)


def key_chunks(
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    *,
    chunk_bytes: int,
    key_columns: Sequence[str] | None = None,
) -> Iterator[pa.Table]:
    """Groups record batches into tables of about ``chunk_bytes``. With ``key_columns``
    (the input sorted so that equal keys are adjacent), a chunk is never cut inside a
    run of equal keys: the rows sharing the last row's key move to the next chunk."""
    pending: list[pa.RecordBatch] = []
    held = 0
    for b in batches:
        if b.num_rows == 0:
            continue
        pending.append(b)
        held += b.nbytes
        if held < chunk_bytes:
            continue
        t = pa.Table.from_batches(pending, schema=schema)
        cut = t.num_rows if not key_columns else _last_key_start(t, key_columns)
        if cut == 0:  # one key so far: keep gathering
            continue
        yield t.slice(0, cut)
        rest = t.slice(cut)
        pending = rest.to_batches() if rest.num_rows else []
        held = rest.nbytes if rest.num_rows else 0
    if pending:
        yield pa.Table.from_batches(pending, schema=schema)


def _last_key_start(t: pa.Table, key_columns: Sequence[str]) -> int:
    """The index of the first row of the trailing run of rows equal (in ``key_columns``)
    to the last row."""
    keys = t.select(list(key_columns))
    n = t.num_rows
    last = keys.slice(n - 1, 1).to_pylist()[0]
    step = 64
    end = n - 1  # rows [end, n) are known to equal the last
    while end > 0:
        lo = max(0, end - step)
        block = keys.slice(lo, end - lo).to_pylist()
        for i in range(len(block) - 1, -1, -1):
            if block[i] != last:
                return lo + i + 1
        end = lo
        step *= 4
    return 0


def _plain(v: Any) -> Any:
    """JSON-able form of a GE sample value (numpy scalars, NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    return str(v)


def latest_as_of(persist: PersistResource, collection: str) -> int | None:
    """The collection's latest decided time (``upper - 1`` over its metadata and active
    rendition), or None before the first write."""
    desc = persist.controller().describe(collection)
    upper = desc["metadata_upper"]
    active = desc["active_rendition"]
    r_upper = desc["renditions"][active]["upper"] if active else None
    if not upper or not r_upper or min(upper[0], r_upper[0]) == 0:
        return None
    return int(min(upper[0], r_upper[0])) - 1


def read_latest(persist: PersistResource, collection: str) -> tuple["pd.DataFrame", int | None]:
    """The collection's contents at ``upper - 1`` as pandas (empty before the first write).

    Whole in memory: for large collections iterate ``snapshot_batches`` instead, as the
    checks do."""
    import pandas as pd

    as_of = latest_as_of(persist, collection)
    if as_of is None:
        return pd.DataFrame(), None
    with persist.controller().acquire_read_handle(collection) as reader:
        table = reader.snapshot(as_of)
    return table.to_pandas(), as_of


def validate_collection(
    persist: PersistResource,
    collection: str,
    rules: CollectionRules,
    as_of: int,
    *,
    rendition: str | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> ValidationOutcome:
    """Validates the collection's contents at ``as_of`` chunk by chunk, streaming them
    (see the module docstring): memory stays about ``memory_budget`` however large the
    collection. ``rendition``: validate that rendition's contents at ``as_of`` (e.g. a
    rebuilt one before it is handed over to) instead of the active one's."""
    with persist.controller().acquire_read_handle(collection) as reader:
        key_fields = set(reader.schemas.key_names)
        notes: list[str] = []
        grouped = bool(rules.key_columns) and set(rules.key_columns) == key_fields
        if rules.unique_key and not grouped:
            notes.append(
                f"key columns {list(rules.key_columns)} are not the collection key "
                f"{sorted(key_fields)}: uniqueness was checked within each chunk only"
            )
        budget = max(MiB, memory_budget // 2)
        if rendition is None:
            opened = reader.snapshot_batches(as_of, memory_budget=budget)
        else:
            readers = reader.rendition_readers(rendition, own_schemas=True)  # maybe rebuilt under new schemas
            opened = _rendition_stream(readers, as_of, budget)
        with opened as stream:
            chunks = key_chunks(
                stream, stream.schema, chunk_bytes=max(64 << 10, memory_budget // 32),
                key_columns=list(rules.key_columns) if rules.unique_key and grouped else None,
            )
            v = _Validator(rules)
            for t in chunks:
                v.validate(t.to_pandas())
                del t
            if v.chunks == 0:  # no rows: validate the empty frame (with its columns)
                v.validate(stream.schema.empty_table().to_pandas())
        return v.outcome(notes)


def _rendition_stream(readers: Sequence[Any], as_of: int, memory_budget: int) -> Any:
    """The contents of one rendition at ``as_of``: its shards' streams one after the
    other (a key lives in one shard, so nothing consolidates across them). Each stream
    releases its hold when exhausted; closing the result releases them all."""
    from persist_lib.handles.batch_stream import BatchStream

    per_shard = max(MiB, memory_budget // max(1, len(readers)))
    with ExitStack() as opening:  # a failed open releases the streams opened before it
        streams = [opening.enter_context(r.snapshot_batches(as_of, memory_budget=per_shard)) for r in readers]
        held = opening.pop_all()
    return BatchStream(itertools.chain.from_iterable(streams), streams[0].schema, held.close)


def build_collection_check(
    asset: dg.AssetKey | dg.AssetsDefinition | str,
    collection: str,
    rules: CollectionRules,
    *,
    name: str = "ge_contents",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> dg.AssetChecksDefinition:
    """A blocking GE asset check on the latest contents of ``collection``, validated in
    chunks within about ``memory_budget``."""

    @dg.asset_check(
        asset=asset,
        name=name,
        blocking=True,
        description=(
            f"Great Expectations on {collection!r} at its latest time: keys not null, value "
            "ranges, positive accumulated diffs" + (", unique keys" if rules.unique_key else "")
        ),
    )
    def _check(persist: PersistResource) -> dg.AssetCheckResult:
        as_of = latest_as_of(persist, collection)
        if as_of is None:
            return dg.AssetCheckResult(
                passed=True, metadata={"rows": 0, "note": "the collection holds no data yet"}
            )
        outcome = validate_collection(persist, collection, rules, as_of, memory_budget=memory_budget)
        return dg.AssetCheckResult(
            passed=outcome.passed,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={**time_point("as_of", as_of), **outcome.metadata()},
            description=None
            if outcome.passed
            else "failed: " + ", ".join(f["expectation"] for f in outcome.failures),
        )

    return _check


def build_errors_check(
    asset: dg.AssetKey | str, collection: str, *, name: str = "no_decode_errors"
) -> dg.AssetChecksDefinition:
    """A non-blocking (WARN) check: the errors collection holds no records."""

    @dg.asset_check(
        asset=asset,
        name=name,
        blocking=False,
        description=f"Warns when {collection!r} holds records that failed to decode.",
    )
    def _check(persist: PersistResource) -> dg.AssetCheckResult:
        count = 0
        sample: list[dict[str, Any]] = []
        as_of = latest_as_of(persist, collection)
        if as_of is not None:
            with persist.controller().acquire_read_handle(collection) as reader:
                with reader.snapshot_batches(as_of) as stream:
                    for b in stream:  # streamed: the count and the first rows only
                        count += int(pc.sum(b.column("diff")).as_py() or 0)
                        for row in b.slice(0, SAMPLE - len(sample)).to_pylist():
                            raw = row.get("raw")
                            sample.append(
                                {
                                    "address": row["address"],
                                    "kind": row["kind"],
                                    "reason": row["reason"][:200],
                                    # the record as text (escaped where it is not UTF-8)
                                    "raw": None if raw is None else bytes_text(raw)[:200],
                                }
                            )
        if not count:
            sample = []
        return dg.AssetCheckResult(
            passed=count == 0,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"error_records": count, "sample": dg.MetadataValue.json(sample)},
        )

    return _check


def rules_for(
    key_columns: Sequence[str],
    *,
    not_null: Sequence[str] = (),
    ranges: Mapping[str, tuple[float | None, float | None]] | None = None,
    unique_key: bool = False,
) -> CollectionRules:
    """``CollectionRules`` from plain sequences."""
    return CollectionRules(tuple(key_columns), tuple(not_null), dict(ranges or {}), unique_key)
