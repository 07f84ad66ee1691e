"""Rebuild an ingestion's outputs from its raw collection, with fixed decoding logic.

The raw collection (``IngestConfig(keep_raw=True)``) holds every undecoded record at
the time it was bound: it is an *already reclocked* source (seed 001, "Variations").
When the decoding or the envelope had a bug, or the source no longer has the data
(files deleted, the replication slot advanced), a new rendition can be rebuilt from
it: each raw time ``t`` is decoded with the new logic and appended at the same ``t``,
so the rebuilt outputs line up time by time with everything else, and a handover
(``StorageController.handover``) can switch readers over at any time both cover.

The rebuild is itself resumable and definite: it restarts at the minimum upper of the
new outputs (rehydrating the envelope's state there) and writes with verified definite
appends, so it can be killed and rerun, or run twice at once.

Typical flow with STORAGE collections (``rebuild_rendition`` does steps 1-2):

1. ``ctl.create_rendition(c, "r1", n)`` for ``name``, ``name.errors``, ``name.state``;
2. ``rebuild_from_raw(..., outputs=StorageOutputs(ctl, name, rendition="r1"))``;
3. keep ingesting into ``r1`` (``Ingestion(..., outputs=StorageOutputs(..., rendition="r1"))``)
   and stop the ingestion into the old rendition;
4. ``ctl.handover(c, to="r1", at=t)`` for each collection once ``r1`` is beyond ``t``.

Errors that came from remap notes (late or vanished files) are not in the raw
collection and so are not rebuilt; decoding errors are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist_lib.ingest.addresses import Address, decode_address
from persist_lib.ingest.atomic_append import append_atomically
from persist_lib.ingest.decode import (
    DELETE_COL,
    ERRORS_KEY,
    ERRORS_VAL,
    RAW_KEY,
    RAW_VAL,
    TRUNCATE_COL,
    UNCHANGED_COL,
    DecodeSpec,
    ErrorRecord,
    decode_json_lines,
    errors_table,
    merge_good_and_bad,
)
from persist_lib.ingest.envelope import make_envelope
from persist_lib.ingest.errors import IngestConfigError, IngestInvariantError
from persist_lib.ingest.outputs import Output, OutputFactory, ShardOutputs, shard_id_for, txns_of
from persist_lib.txn.txns import Txns

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.handles.client import PersistClient


def _full_rows(spec: DecodeSpec, rows: pa.Table) -> pa.Table:
    """Adds the CDC columns (unchanged, truncate) so rows of every format concatenate."""
    n = rows.num_rows
    if UNCHANGED_COL not in rows.column_names:
        rows = rows.append_column(UNCHANGED_COL, pa.nulls(n, pa.list_(pa.string())))
    if TRUNCATE_COL not in rows.column_names:
        rows = rows.append_column(TRUNCATE_COL, pa.array(np.zeros(n, dtype=bool)))
    names = spec.key_names + spec.val_names + [DELETE_COL, UNCHANGED_COL, TRUNCATE_COL]
    return rows.select(names)


def decode_raw(spec: DecodeSpec, raw: pa.Table, envelope: str = "append_only") -> tuple[pa.Table, list[ErrorRecord]]:
    """Decodes the raw records of one time (any order) with ``spec``: rows + errors
    (``envelope``: Kafka tombstones are deletes only for ``upsert``)."""
    from persist_lib.ingest.csv_records import decode_csv_records
    from persist_lib.ingest.pg_cdc import decode_change_records

    recs = raw.to_pylist()
    for r in recs:
        if r["diff"] != 1:
            raise IngestInvariantError(f"raw record {r['partition']}/{r['address']} has multiplicity {r['diff']}")
    recs.sort(key=lambda r: (r["partition"], decode_address(r["address"])))
    out_rows: list[pa.Table] = []
    errors: list[ErrorRecord] = []
    i = 0
    while i < len(recs):
        fmt = recs[i]["format"]
        j = i
        header = None
        if fmt == "csv-json":
            header = json.loads(recs[i]["raw"])["h"]
        while j < len(recs) and recs[j]["format"] == fmt and (
            header is None or json.loads(recs[j]["raw"])["h"] == header
        ):
            j += 1
        run = recs[i:j]
        addrs: list[tuple[str, Address]] = [(r["partition"], decode_address(r["address"])) for r in run]
        raws: list[bytes] = [r["raw"] for r in run]
        if fmt in ("jsonl", "parquet-json"):
            table, bad = decode_json_lines(spec, raws)
            rows, bad_all = merge_good_and_bad(spec, len(raws), table, bad)
        elif fmt == "csv-json":
            assert header is not None
            objs = [json.loads(x) for x in raws]
            unparsed = {k: o["e"] for k, o in enumerate(objs) if "e" in o}
            rows, bad_all = decode_csv_records(spec, header, [o["f"] for o in objs], unparsed)
        elif fmt == "pgoutput-json":
            objs = [json.loads(x) for x in raws]
            rows, bad_all = decode_change_records(
                spec,
                [o["values"] for o in objs],
                [bool(o["delete"]) for o in objs],
                [bool(o["truncate"]) for o in objs],
                [o.get("unchanged") or None for o in objs],
            )
        elif fmt == "kafka":
            from persist_lib.ingest.kafka.raw import decode_kafka_raw

            rows, bad_all = decode_kafka_raw(spec, envelope, [p for p, _ in addrs], [int(a[0]) for _, a in addrs], raws)
        else:
            raise IngestConfigError(f"raw records of unknown format {fmt!r}: this rebuild can't decode them")
        out_rows.append(_full_rows(spec, rows))
        for k, kind, reason in bad_all:
            p, a = addrs[k]
            errors.append(ErrorRecord(p, a, kind, reason, raws[k]))
        i = j
    if not out_rows:
        return _full_rows(spec, spec.rows_schema().empty_table()), errors
    return pa.concat_tables(out_rows), errors


def _empty_user(key: pa.Schema, val: pa.Schema) -> pa.Table:
    return pa.schema(list(key) + list(val) + [pa.field("ts", pa.int64()), pa.field("diff", pa.int64())]).empty_table()


def rebuild_from_raw(
    client: PersistClient,
    name: str,
    key_schema: pa.Schema,
    val_schema: pa.Schema,
    *,
    outputs: OutputFactory,
    raw_from: OutputFactory | None = None,
    envelope: str = "append_only",
    delete_field: str | None = None,
    transform: Callable[[pa.Table], pa.Table] | None = None,
    bindings_per_read: int = 50,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Rebuilds ``outputs`` (data, errors, state) of ingestion ``name`` from its raw collection.

    ``raw_from`` is where the raw collection lives (default: the plain shards of
    ``name``). Returns a summary: ``upper``, ``resumed_at``, ``records``, ``errors``,
    ``times``, ``duration_s``.
    """
    from persist_lib.ingest.remap import REMAP_KEY, REMAP_VAL

    t_start = time.monotonic()
    spec = DecodeSpec(key_schema, val_schema, delete_field=delete_field)
    env = make_envelope(envelope, spec)
    raw_out: Output = (raw_from or ShardOutputs(client, name)).open("raw", RAW_KEY, RAW_VAL)
    roles = ["data", "errors"] + (["state"] if env.needs_state else [])
    schemas = {"data": (key_schema, val_schema), "state": (key_schema, val_schema), "errors": (ERRORS_KEY, ERRORS_VAL)}
    outs = {r: outputs.open(r, *schemas[r]) for r in roles}
    empties = {r: _empty_user(*schemas[r]) for r in roles}
    remap_r = client.open_leased_reader(shard_id_for(name, "remap"), REMAP_KEY, REMAP_VAL, purpose=f"rebuild:{name}")
    stats = {"records": 0, "errors": 0, "times": 0}
    own = txns_of(outputs)
    txns = own or Txns(client)
    shards = [p.shard_id for o in outs.values() for p in o.shard_outputs()]
    try:
        txns.register(shards)
        txns.ensure_applied(shards)
        t = min(o.upper() for o in outs.values())
        resumed_at = t
        raw_upper = raw_out.upper()
        raw_since = raw_out.since()
        env.rehydrate(outs["state"].snapshot(t - 1) if env.needs_state and t > 0 else None)

        def write(per_time: dict[int, pa.Table], lower: int, upper: int) -> None:
            acc: dict[str, list[pa.Table]] = {r: [] for r in roles}
            for tt in sorted(per_time):
                rows, errs = decode_raw(spec, per_time[tt], env.kind)
                if transform is not None:
                    base = rows.select(spec.key_names + spec.val_names + [DELETE_COL])
                    rows = _full_rows(spec, transform(base))
                out_ups, state_ups = env.apply(rows, tt)
                acc["data"].append(out_ups)
                if errs:
                    acc["errors"].append(errors_table(errs, tt))
                if "state" in acc and state_ups is not None:
                    acc["state"].append(state_ups)
                stats["records"] += per_time[tt].num_rows
                stats["errors"] += len(errs)
                stats["times"] += 1
            pieces = []
            tables = {}
            for r, o in outs.items():
                ts = [x for x in acc[r] if x.num_rows]
                tables[r] = pa.concat_tables([x.cast(empties[r].schema) for x in ts]) if ts else empties[r]
                pieces += o.shard_pieces(tables[r])
            # Outputs that write elsewhere (Spark executors) may take the whole append; it
            # is one transaction either way.
            bulk = getattr(outputs, "append_all", None)
            if bulk is None or not bulk(txns, [(outs[r], tables[r]) for r in outs], lower, upper):
                append_atomically(txns, list(pieces), lower, upper)  # every output in one transaction
            for _, o in sorted(outs.items(), key=lambda kv: kv[0] == "data"):  # data last
                o.committed(upper)
            if progress is not None:
                progress({"upper": upper, **stats})

        if t < raw_since:
            # history before the raw since was compacted: it all lands at the since
            snap = raw_out.snapshot(raw_since)
            write({raw_since: snap} if snap.num_rows else {}, t, raw_since + 1)
            t = raw_since + 1
        # the binding times (where the raw collection can have records) from the remap
        rupper = remap_r._machine.fetch_latest().upper.time or 0
        lo_r = max(t, (remap_r.since.time or 0) + 1)
        binding_times = sorted(
            {int(x) for x in remap_r.updates_between(lo_r, min(rupper, raw_upper)).column("ts").to_pylist()}
        ) if rupper > lo_r else []
        while t < raw_upper:
            window = [bt for bt in binding_times if bt >= t][:bindings_per_read]
            hi = raw_upper if len(window) < bindings_per_read else window[-1] + 1
            ups = raw_out.updates_between(t, hi)
            per_time: dict[int, pa.Table] = {}
            if ups.num_rows:
                ts_col = ups.column("ts").to_numpy()
                for tt in np.unique(ts_col):
                    per_time[int(tt)] = ups.filter(pa.array(ts_col == tt))
            write(per_time, t, hi)
            t = hi
        return {
            "name": name,
            "resumed_at": resumed_at,
            "upper": t,
            **stats,
            "outputs": {r: o.describe() for r, o in outs.items()},
            "duration_s": round(time.monotonic() - t_start, 3),
        }
    finally:
        if own is None:
            txns.close()
        remap_r.expire()
        raw_out.close()
        for o in outs.values():
            o.close()


def rebuild_rendition(
    ctl: Any,
    client: PersistClient,
    name: str,
    rendition: str,
    key_schema: pa.Schema,
    val_schema: pa.Schema,
    *,
    num_shards: int = 1,
    **kwargs: Any,
) -> dict[str, Any]:
    """Creates ``rendition`` in the ingestion's STORAGE collections (if missing) and rebuilds it.

    The raw collection is read from the STORAGE collection ``name.raw`` (its active
    rendition). Then keep ingesting into the rendition and hand over (module docstring).
    """
    from persist_lib.ingest.outputs import StorageOutputs, collection_name

    env = make_envelope(kwargs.get("envelope", "append_only"), DecodeSpec(key_schema, val_schema, kwargs.get("delete_field")))
    roles = ["data", "errors"] + (["state"] if env.needs_state else [])
    for r in roles:
        cname = collection_name(name, r)
        if rendition not in ctl.describe(cname)["renditions"]:
            # Data and state take the rebuild's schemas (a schema change that can't be
            # made in place is rebuilt this way); the errors collection's never change.
            schemas = {"key_schema": key_schema, "val_schema": val_schema} if r in ("data", "state") else {}
            ctl.create_rendition(cname, rendition, num_shards, **schemas)
    return rebuild_from_raw(
        client, name, key_schema, val_schema,
        outputs=StorageOutputs(ctl, name, num_shards=num_shards, rendition=rendition),
        raw_from=StorageOutputs(ctl, name, num_shards=num_shards), **kwargs,
    )
