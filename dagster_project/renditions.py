"""Rendition backfill: rebuild a collection from its raw collection, then hand over.

``backfill_rendition(spec, ctl, landing_uri, rendition)`` for a source ``<name>``:

1. **create** rendition ``rendition`` of ``<name>`` (and of ``<name>.state`` for the
   upsert envelope), possibly with another number of shards;
2. **build** it from ``<name>.raw``: the raw records are read back at the times they
   were bound to, decoded with the *current* decoding logic (schema + ``transform``)
   and passed through the envelope, time by time, exactly as the ingestion would; the
   result is appended to the new rendition (through Spark when a session is given).
   The build resumes where a previous attempt stopped (the envelope state is
   rehydrated from the new state rendition) and repeats until it has caught up with
   the raw collection;
3. **catch up** past the active rendition: one ingestion pass whose data/state outputs
   are the new renditions (errors and raw are the collections' own and are verified
   equal). It applies the bindings after the build and advances the new renditions to
   the clock, so they are readable beyond the active rendition's upper ``at``;
4. **hand over** at ``at`` (each collection: ``<name>``, ``<name>.state``); every
   reader sees one definite collection (the collection reader switches at ``at``);
5. **allow compaction** up to ``at + 1`` and **collect** the old renditions once no
   reader holds them (a reader still before ``at`` defers that to the GC job).

The ingestion and the backfill of one source should not run at the same time (the
hand-over retries if an ingestion moved the active rendition meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dagster_project.ingestion import make_ingestion
from dagster_project.sources import SourceSpec
from persist_lib.errors import InvalidUsage
from persist_lib.ingest.decode import DecodeSpec, decode_json_lines, merge_good_and_bad
from persist_lib.ingest.envelope import make_envelope
from persist_lib.ingest.outputs import CollectionOutput, collection_name
from persist_lib.ingest.source import decode_address
from persist_lib.storage import StorageController

log = logging.getLogger(__name__)

JSON_RAW_FORMATS = ("jsonl", "parquet-json")
MAX_ROUNDS = 10


class RenditionOutputs:
    """Ingestion outputs whose ``roles`` go to rendition ``rendition`` (others: active)."""

    def __init__(self, ctl: StorageController, name: str, rendition: str, roles: set[str]) -> None:
        self.ctl = ctl
        self.name = name
        self.rendition = rendition
        self.roles = roles

    def open(self, role: str, key_schema: pa.Schema, val_schema: pa.Schema) -> Any:
        r = self.rendition if role in self.roles else None
        return CollectionOutput(self.ctl, collection_name(self.name, role), role, r)

    def describe(self) -> dict[str, Any]:
        return {"kind": "storage", "name": self.name, "rendition": self.rendition}


def rendition_roles(spec: SourceSpec) -> list[str]:
    """The outputs a rendition covers: the data, and the state of the upsert envelope."""
    return ["data", "state"] if spec.envelope == "upsert" else ["data"]


def _upper(desc: dict[str, Any], rendition: str) -> int:
    u = desc["renditions"][rendition]["upper"]
    if not u:
        raise InvalidUsage(f"{desc['name']}/{rendition}: its upper is closed")
    return int(u[0])


class RawRebuild:
    """Builds renditions of a source's data (and state) from its raw collection."""

    def __init__(
        self,
        spec: SourceSpec,
        ctl: StorageController,
        rendition: str,
        *,
        spark: Callable[[], Any] | None = None,
    ) -> None:
        self.spec = spec
        self.ctl = ctl
        self.rendition = rendition
        self.spark = spark
        self.dspec = DecodeSpec(spec.key_schema, spec.val_schema, delete_field=spec.delete_field)
        self.envelope = make_envelope(spec.envelope, self.dspec)
        self.roles = rendition_roles(spec)
        self.names = {r: collection_name(spec.name, r) for r in self.roles}
        self.raw_name = collection_name(spec.name, "raw")
        self.stats = {
            "raw_records": 0,
            "times": 0,
            "updates": 0,
            "rounds": 0,
            "engine": "in-process",
        }
        self._rehydrated = False

    def new_upper(self) -> int:
        return min(_upper(self.ctl.describe(n), self.rendition) for n in self.names.values())

    def raw_upper(self) -> int:
        d = self.ctl.describe(self.raw_name)
        return _upper(d, d["active_rendition"])

    def _rehydrate(self, lower: int) -> None:
        state = None
        if lower > 0 and self.envelope.needs_state:
            out = CollectionOutput(self.ctl, self.names["state"], "state", self.rendition)
            try:
                state = out.snapshot(lower - 1)
            finally:
                out.close()
        self.envelope.rehydrate(state)
        self._rehydrated = True

    def _raw_updates(self, lower: int, upper: int) -> pa.Table:
        """Raw records with times in ``[lower, upper)`` (user layout)."""
        with self.ctl.acquire_read_handle(self.raw_name) as reader:
            since = reader.since.time or 0
            if lower > 0 and since >= lower:
                raise InvalidUsage(
                    f"{self.raw_name}: history before {since} was compacted, but the rebuild of "
                    f"{self.rendition} resumes at {lower}; drop the half-built rendition and start "
                    "a new one"
                )
            parts = []
            base = max(lower - 1, since, 0)
            if lower <= base:
                snap = reader.snapshot(base)
                parts.append(snap)
            if upper - 1 > base:
                parts.append(reader.listen(base).read_until(upper))
            tables = [p for p in parts if p.num_rows]
            if not tables:
                return parts[0].schema.empty_table() if parts else pa.table({})
            return pa.concat_tables(tables)

    def _decode(self, raw: pa.Table) -> pa.Table:
        """Rows (``DecodeSpec.rows_schema``) of raw records already in address order."""
        fmts = set(raw.column("format").to_pylist())
        bad = fmts - set(JSON_RAW_FORMATS)
        if bad:
            raise InvalidUsage(
                f"{self.raw_name}: raw records of format {sorted(bad)} can't be decoded on their "
                "own (CSV raw records lack their header); rebuild this source from its landing "
                "zone instead"
            )
        lines = [r for r in raw.column("raw").to_pylist()]
        table, errs = decode_json_lines(self.dspec, lines)
        rows, _ = merge_good_and_bad(self.dspec, len(lines), table, errs)
        if self.spec.transform is not None:
            rows = self.spec.transform(rows)
        return rows

    def build(self, lower: int, upper: int) -> int:
        """Appends the rendition's updates for ``[lower, upper)``; returns updates written."""
        if not self._rehydrated:
            self._rehydrate(lower)
        raw = self._raw_updates(lower, upper)
        outs: dict[str, list[pa.Table]] = {r: [] for r in self.roles}
        if raw.num_rows:
            raw = raw.filter(pc.greater(raw["diff"], 0))
            order = sorted(
                range(raw.num_rows),
                key=lambda i, ts=raw["ts"].to_pylist(), ad=raw["address"].to_pylist(): (
                    ts[i],
                    decode_address(ad[i]),
                ),
            )
            raw = raw.take(pa.array(order, pa.int64()))
            ts = raw["ts"].to_numpy()
            starts = [0] + [i for i in range(1, len(ts)) if ts[i] != ts[i - 1]] + [len(ts)]
            for a, b in zip(starts, starts[1:], strict=False):
                t = int(ts[a])
                chunk = raw.slice(a, b - a)
                out, state = self.envelope.apply(self._decode(chunk), t)
                outs["data"].append(out)
                if "state" in outs and state is not None:
                    outs["state"].append(state)
                self.stats["times"] += 1
                self.stats["raw_records"] += chunk.num_rows
        written = 0
        for role in self.roles:
            written += self._append(role, outs[role], lower, upper)
        self.stats["rounds"] += 1
        self.stats["updates"] += written
        return written

    def _append(self, role: str, tables: list[pa.Table], lower: int, upper: int) -> int:
        w = self.ctl.open_writer(self.names[role], self.rendition)
        try:
            schema = pa.schema(
                list(self.dspec.key_schema)
                + list(self.dspec.val_schema)
                + [pa.field("ts", pa.int64()), pa.field("diff", pa.int64())]
            )
            tables = [t.cast(schema) for t in tables if t.num_rows]
            table = pa.concat_tables(tables) if tables else schema.empty_table()
            if self.spark is not None and table.num_rows:
                from persist_lib.spark import write_collection

                spark = self.spark()
                df = spark.createDataFrame(table.to_pandas())
                write_collection(df, w, lower, upper)
                self.stats["engine"] = "spark"
            else:
                w.append(table, lower, upper)
            return table.num_rows
        finally:
            w.expire()

    def build_until_caught_up(self) -> dict[str, Any]:
        """Builds from the new rendition's upper to the raw upper until they meet."""
        for _ in range(MAX_ROUNDS):
            lower, upper = self.new_upper(), self.raw_upper()
            if lower >= upper:
                break
            self.build(lower, upper)
        return dict(self.stats, upper=self.new_upper())


def ensure_renditions(
    spec: SourceSpec, ctl: StorageController, rendition: str, num_shards: int
) -> list[str]:
    """Creates ``rendition`` in every collection it covers; returns those created now."""
    created = []
    for role in rendition_roles(spec):
        name = collection_name(spec.name, role)
        info = ctl.describe(name)["renditions"].get(rendition)
        if info is None:
            ctl.create_rendition(name, rendition, num_shards)
            created.append(name)
        elif info["status"] != "ready" or info.get("retired_at") is not None:
            raise InvalidUsage(
                f"collection {name!r}: rendition {rendition!r} exists but is {info['status']}"
                f"{' (retired)' if info.get('retired_at') is not None else ''}; pick a new name"
            )
    return created


def backfill_rendition(
    spec: SourceSpec,
    ctl: StorageController,
    landing_uri: str,
    rendition: str,
    *,
    num_shards: int | None = None,
    spark: Callable[[], Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Builds ``rendition`` from the raw collection and hands over to it (module docstring)."""
    say = progress or log.info
    name = spec.name
    desc = ctl.describe(name)
    old = desc["active_rendition"]
    if old == rendition:
        return {"rendition": rendition, "status": "already active", "handover_at": None}
    n = num_shards or spec.num_shards
    created = ensure_renditions(spec, ctl, rendition, n)
    say(f"{name}: rendition {rendition} ({n} shards) ready; created in {created or 'none'}")
    rebuild = RawRebuild(spec, ctl, rendition, spark=spark)
    built = rebuild.build_until_caught_up()
    say(f"{name}: built {rendition} from {rebuild.raw_name} up to {built['upper']}: {built}")
    roles = set(rendition_roles(spec))
    handovers: dict[str, int] = {}
    catch_up: dict[str, Any] = {}
    for _ in range(MAX_ROUNDS):
        with make_ingestion(
            spec,
            ctl,
            landing_uri,
            outputs=RenditionOutputs(ctl, name, rendition, roles),
            spark=spark,
        ) as ing:
            catch_up = ing.run_once()
        say(
            f"{name}: caught {rendition} up to {catch_up['upper']} "
            f"({catch_up['records']} new records)"
        )
        try:
            for role in sorted(roles, key=lambda r: r != "data"):
                cname = collection_name(name, role)
                d = ctl.describe(cname)
                if d["active_rendition"] == rendition:
                    continue
                at = _upper(d, d["active_rendition"])
                ctl.handover(cname, to=rendition, at=at)
                handovers[cname] = at
            break
        except InvalidUsage as e:  # an ingestion moved the active rendition: catch up again
            say(f"{name}: hand-over refused ({e}); catching up again")
    else:
        raise InvalidUsage(f"{name}: could not hand over to {rendition} after {MAX_ROUNDS} tries")
    at = handovers.get(name)
    say(f"{name}: handed over to {rendition} at {handovers}")
    # One more pass moves the metadata upper past the hand-over, so the controller's own
    # hold (kept at upper - 1) can pass it and the old rendition can be collected.
    with make_ingestion(spec, ctl, landing_uri, spark=spark) as ing:
        ing.run_once()
    collected: dict[str, Any] = {}
    for cname, t in handovers.items():
        ctl.allow_compaction(cname, t + 1)
        collected.update(ctl.collect_renditions(cname))
    return {
        "collection": name,
        "rendition": rendition,
        "previous": old,
        "num_shards": n,
        "handover_at": at,
        "handovers": handovers,
        "built": built,
        "catch_up_records": catch_up.get("records", 0),
        "collected": collected,
    }
