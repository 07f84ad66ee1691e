"""Rendition backfill: rebuild a collection from its raw collection, then hand over.

``backfill_rendition(spec, ctl, landing_uri, rendition)`` for a source ``<name>``:

1. **create** rendition ``rendition`` of ``<name>``, ``<name>.errors`` and (upsert)
   ``<name>.state``, possibly with another number of shards;
2. **build** it from ``<name>.raw`` with ``persist_lib.ingest.rebuild.rebuild_from_raw``:
   every raw time is decoded with the *current* decoding logic (schema + ``transform``)
   and passed through the envelope at the same time, resumably, with verified
   appends. With Spark, big appends are written by executors
   (``persist_lib.spark.write_collection``);
3. **catch up** past the active rendition: one ingestion pass writing the new
   renditions (``StorageOutputs(rendition=...)``; raw stays the collection's own). It
   applies the bindings after the build and advances the new renditions to the clock, so
   they are readable beyond the active rendition's upper ``at``;
4. **check** the rebuilt rendition's contents at ``at`` (the blocking Great
   Expectations suite, passed in as ``check``): a failure raises
   ``RenditionCheckFailed`` and nothing is handed over;
5. **hand over** every collection at ``at``; the collection reader switches at ``at``,
   so each reader sees one definite collection;
6. **allow compaction** up to ``at + 1`` and **collect** the old renditions once no
   reader holds them (a reader still before ``at`` defers that to the GC job).

The ingestion and the backfill of one source should not run at the same time; if an
ingestion moves the active rendition meanwhile, the hand-over is refused and steps 3-4
are retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from dagster_project.ingestion import make_ingestion
from dagster_project.sources import SourceSpec
from persist_lib.errors import InvalidUsage
from persist_lib.ingest.outputs import CollectionOutput, StorageOutputs, collection_name
from persist_lib.ingest.rebuild import rebuild_from_raw
from persist_lib.storage import StorageController
from persist_lib.timefmt import frontier_text, time_text

log = logging.getLogger(__name__)

MAX_ROUNDS = 10
SPARK_MIN_ROWS = 1  # appends at least this big go through Spark when it is configured


def rendition_roles(spec: SourceSpec) -> list[str]:
    """The outputs a rendition covers: data, errors, and the upsert envelope's state."""
    return ["data", "errors", "state"] if spec.envelope == "upsert" else ["data", "errors"]


def _upper(desc: dict[str, Any], rendition: str) -> int:
    u = desc["renditions"][rendition]["upper"]
    if not u:
        raise InvalidUsage(f"{desc['name']}/{rendition}: its upper is closed")
    return int(u[0])


class RenditionCheckFailed(InvalidUsage):
    """The contents of a rebuilt rendition failed its blocking check: nothing was handed
    over (the rendition stays built, ``ready``; the active rendition is unchanged)."""

    def __init__(self, message: str, *, rendition: str, at: int, outcome: Any) -> None:
        super().__init__(message)
        self.rendition = rendition
        self.at = at
        self.outcome = outcome


#: ``check(rendition, at)``: validates the rebuilt rendition's contents at the time it
#: would be handed over at; returns (passed, outcome, reason).
RenditionCheck = Callable[[str, int], tuple[bool, Any, str]]


class SparkCollectionOutput(CollectionOutput):
    """A rendition output whose appends at the rendition's upper are written by Spark."""

    def __init__(
        self, spark: Callable[[], Any], ctl: StorageController, name: str, role: str, rendition: str
    ) -> None:
        super().__init__(ctl, name, role, rendition)
        self._spark = spark
        self.spark_appends = 0

    def append(self, updates: pa.Table, lower: int, upper: int) -> None:
        if upper <= lower:
            return
        if updates.num_rows < SPARK_MIN_ROWS or self.upper() != lower:
            super().append(updates, lower, upper)  # verified definite append, in-process
            return
        from persist_lib.spark import spark_schema, write_collection

        spark = self._spark()
        df = spark.createDataFrame(updates.to_pandas(), schema=spark_schema(self.schemas))
        write_collection(df, self._cw, lower, upper)
        self.spark_appends += 1
        self.stats.written += 1

    def dataframe(self, updates: pa.Table) -> Any:
        from persist_lib.spark import spark_schema

        return self._spark().createDataFrame(updates.to_pandas(), schema=spark_schema(self.schemas))


class SparkRenditionOutputs(StorageOutputs):
    """``StorageOutputs`` of a rendition whose data/errors/state appends go through Spark."""

    def __init__(
        self, spark: Callable[[], Any], ctl: StorageController, name: str, rendition: str
    ) -> None:
        super().__init__(ctl, name, rendition=rendition)
        self.spark = spark
        self.opened: list[SparkCollectionOutput] = []

    def append_all(
        self, txns: Any, tables: list[tuple[Any, pa.Table]], lower: int, upper: int
    ) -> bool:
        """A rebuild's append of every output over ``[lower, upper)``: written by Spark
        executors and committed as ONE transaction (``persist_lib.spark.write_collections``)
        when it is big and every output is at ``lower``; False leaves it to the in-process
        verified append (small, or resuming where another instance wrote)."""
        from persist_lib.spark import write_collections

        outs = [(o, t) for o, t in tables if isinstance(o, SparkCollectionOutput)]
        if (
            upper <= lower or len(outs) != len(tables)
            or sum(t.num_rows for _, t in outs) < SPARK_MIN_ROWS
            or any(o.upper() != lower for o, _ in outs)
        ):
            return False
        write_collections([(o.dataframe(t), o._cw) for o, t in outs], lower, upper)
        for o, _ in outs:
            o.spark_appends += 1
            o.stats.written += 1
        return True

    def open(self, role: str, key_schema: pa.Schema, val_schema: pa.Schema) -> Any:
        assert self.rendition is not None
        if role == "raw":
            return super().open(role, key_schema, val_schema)
        out = SparkCollectionOutput(
            self.spark, self.ctl, collection_name(self.name, role), role, self.rendition
        )
        self.opened.append(out)
        return out


def ensure_renditions(
    spec: SourceSpec, ctl: StorageController, rendition: str, num_shards: int
) -> list[str]:
    """Creates ``rendition`` in every collection it covers; returns those created now."""
    created = []
    for role in rendition_roles(spec):
        name = collection_name(spec.name, role)
        info = ctl.describe(name)["renditions"].get(rendition)
        if info is None:
            # Data and state take the source's declared schemas: a change persist can't
            # make in place is rebuilt this way (schema_changes.py); errors' never change.
            own = {"key_schema": spec.key_schema, "val_schema": spec.val_schema} if role != "errors" else {}
            ctl.create_rendition(name, rendition, num_shards, **own)
            created.append(name)
        elif info["status"] not in ("ready", "active"):  # retired, dropped, ...: never rebuilt
            raise InvalidUsage(
                f"collection {name!r}: rendition {rendition!r} exists but is {info['status']}; "
                "pick a new name"
            )
    return created


def build_rendition(
    spec: SourceSpec,
    ctl: StorageController,
    rendition: str,
    *,
    spark: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Step 2: rebuilds ``rendition`` from the raw collection (resumable)."""
    name = spec.name
    outputs: StorageOutputs
    if spark is not None:
        outputs = SparkRenditionOutputs(spark, ctl, name, rendition)
    else:
        outputs = StorageOutputs(ctl, name, rendition=rendition)
    res = rebuild_from_raw(
        ctl.client,
        name,
        spec.key_schema,
        spec.val_schema,
        outputs=outputs,
        raw_from=StorageOutputs(ctl, name),
        envelope=spec.envelope,
        delete_field=spec.delete_field,
        transform=spec.transform,
    )
    spark_appends = sum(o.spark_appends for o in getattr(outputs, "opened", []))
    res["engine"] = "spark" if spark_appends else "in-process"
    res["spark_appends"] = spark_appends
    return res


def backfill_rendition(
    spec: SourceSpec,
    ctl: StorageController,
    landing_uri: str,
    rendition: str,
    *,
    num_shards: int | None = None,
    spark: Callable[[], Any] | None = None,
    progress: Callable[[str], None] | None = None,
    check: RenditionCheck | None = None,
) -> dict[str, Any]:
    """Builds ``rendition`` from the raw collection and hands over to it (module docstring).

    ``check``: run on the rebuilt rendition of ``<name>`` at the handover time, after it
    caught up and before anything is handed over; when it fails, ``RenditionCheckFailed``
    is raised and nothing is handed over."""
    say = progress or log.info
    name = spec.name
    old = ctl.describe(name)["active_rendition"]
    if old == rendition:
        return {"rendition": rendition, "status": "already active", "handover_at": None}
    n = num_shards or spec.default_rendition_shards
    created = ensure_renditions(spec, ctl, rendition, n)
    say(f"{name}: rendition {rendition} ({n} shards) ready; created in {', '.join(created) or 'none'}")
    built = build_rendition(spec, ctl, rendition, spark=spark)
    say(
        f"{name}: built {rendition} from {name}.raw up to {_when(built['upper'])} "
        f"({built['records']} raw records, {built['times']} times, {built['engine']})"
    )
    collections = [collection_name(name, r) for r in rendition_roles(spec)]
    handovers: dict[str, int] = {}
    catch_up: dict[str, Any] = {}
    checked: dict[str, Any] = {}
    for _ in range(MAX_ROUNDS):
        outputs = StorageOutputs(ctl, name, num_shards=n, rendition=rendition)
        with make_ingestion(spec, ctl, landing_uri, outputs=outputs, spark=spark) as ing:
            catch_up = ing.run_once()
        say(f"{name}: caught {rendition} up to {_when(catch_up['upper'])} ({catch_up['records']} records)")
        try:
            if check is not None:
                checked = _check_before_handover(ctl, name, rendition, check, say)
            for cname in collections:
                d = ctl.describe(cname)
                if d["active_rendition"] == rendition:
                    continue
                at = _upper(d, d["active_rendition"])
                ctl.handover(cname, to=rendition, at=at)
                handovers[cname] = at
            break
        except RenditionCheckFailed:
            raise
        except InvalidUsage as e:  # an ingestion moved the active rendition: catch up again
            say(f"{name}: hand-over refused ({e}); catching up again")
    else:
        raise InvalidUsage(f"{name}: could not hand over to {rendition} after {MAX_ROUNDS} tries")
    say(
        f"{name}: handed over to {rendition}: "
        + ", ".join(f"{c} at {time_text(t)}" for c, t in sorted(handovers.items()))
    )
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
        "handover_at": handovers.get(name),
        "handovers": handovers,
        "built": built,
        "catch_up_records": catch_up.get("records", 0),
        "collected": collected,
        "check": checked if check is not None else None,
    }


def _check_before_handover(
    ctl: StorageController, name: str, rendition: str, check: RenditionCheck, say: Callable[[str], None]
) -> dict[str, Any]:
    """Runs ``check`` on ``rendition`` of ``name`` at the time it would be handed over at
    (the active rendition's upper); raises ``RenditionCheckFailed`` if it fails."""
    d = ctl.describe(name)
    if d["active_rendition"] == rendition:  # handed over in an earlier round
        return {"passed": True, "at": None, "outcome": None}
    at = _upper(d, d["active_rendition"])
    new_upper = d["renditions"][rendition]["upper"]
    if not new_upper or new_upper[0] <= at:
        raise InvalidUsage(
            f"{name}/{rendition}: not readable at {time_text(at)} yet (upper {frontier_text(new_upper)})"
        )
    passed, outcome, reason = check(rendition, at)
    if not passed:
        raise RenditionCheckFailed(
            f"{name}: rendition {rendition!r} failed its check at {time_text(at)} ({reason}); nothing was "
            f"handed over, {d['active_rendition']!r} stays active",
            rendition=rendition,
            at=at,
            outcome=outcome,
        )
    say(f"{name}: rendition {rendition} passed its check at {time_text(at)}; handing over")
    return {"passed": True, "at": at, "outcome": outcome}


def _when(t: Any) -> str:
    """A time or frontier for a log line: the integer with its ISO-8601 UTC timestamp."""
    if isinstance(t, list | tuple):
        return frontier_text([int(x) for x in t])
    return time_text(int(t)) if isinstance(t, int) else str(t)
