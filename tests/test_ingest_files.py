"""File landing zone ingestion: decoding errors, late files, configuration errors,
mismatching instances, STORAGE outputs, S3, injected crashes between appends."""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import (
    IngestConfig,
    IngestConfigError,
    Ingestion,
    LandingZoneSource,
    NeedsNewRendition,
    ProgressBar,
    ProgressLog,
    SourceDataGone,
    StorageOutputs,
)
from persist_lib.ingest.decode import DecodeSpec
from persist_lib.ingest.outputs import Output, OutputFactory, ShardOutput, ShardOutputs
from tests.test_ingest_support import DELETE, KEY, VAL, compare_locations, make_zone

ROLES = ["data", "errors", "state", "remap"]


def mem_client() -> tuple[PersistClient, tuple[str, str]]:
    tag = uuid.uuid4().hex
    loc = (f"mem://b-{tag}", f"mem://c-{tag}")
    return PersistClient.open(loc[0], loc[1], PersistConfig.for_tests()), loc


def ingest(client: PersistClient, zone: Path, name: str = "ing", **kw: Any) -> tuple[Ingestion, dict[str, Any]]:
    n = kw.pop("n", 25)
    cfg = kw.pop("config", None) or IngestConfig(max_records_per_binding=n)
    kw.setdefault("envelope", "upsert")
    if kw["envelope"] == "upsert":
        kw.setdefault("delete_field", DELETE)
    ing = Ingestion(client, name, LandingZoneSource(str(zone)), KEY, VAL, config=cfg, clock=kw.pop("clock", lambda: 1), **kw)
    return ing, ing.run_once()


def data_state(ing: Ingestion, upper: int) -> dict[int, tuple[Any, ...]]:
    snap = ing._outs["data"].snapshot(upper - 1).to_pylist()
    assert all(r["diff"] == 1 for r in snap)
    return {r["id"]: (r["name"], r["qty"], r["tag"]) for r in snap}


def errors_of(ing: Ingestion, upper: int) -> list[dict[str, Any]]:
    return ing._outs["errors"].snapshot(upper - 1).to_pylist()


# ----- decoding --------------------------------------------------------------------------


def test_upsert_zone_with_malformed_records(tmp_path: Path) -> None:
    zone = make_zone(tmp_path / "z", seed=1, files=8, rows=30)
    client, _ = mem_client()
    ing, s = ingest(client, zone.path)
    assert data_state(ing, s["upper"]) == zone.final
    errs = errors_of(ing, s["upper"])
    assert len(errs) == zone.bad == s["errors"]
    kinds = Counter(e["kind"] for e in errs)
    assert kinds["unreadable_file"] == 1
    assert set(kinds) <= {"invalid_json", "type_mismatch", "missing_key", "not_an_object", "unreadable_file"}
    for e in errs:
        f, row = json.loads(e["address"])
        assert (zone.path / f).exists() and row >= 0
        assert e["reason"]
    ing.close()


def test_every_kind_of_bad_record_lands_in_errors_with_its_address(tmp_path: Path) -> None:
    z = tmp_path / "z"
    z.mkdir()
    (z / "a.jsonl").write_text(
        "\n".join(
            [
                '{"id": 1, "name": "ok", "qty": 1.5}',
                '{"id": 2, "name": ',  # bad JSON
                '{"id": "three", "name": "x"}',  # wrong type
                '{"name": "no key"}',  # missing key column
                "42",  # not an object
                "",  # blank line: no record
                '{"id": 5, "name": "ok5", "qty": 2}',
            ]
        )
        + "\n"
    )
    (z / "b.csv").write_text("id,name,qty\n6,six,6.5\n7,seven,notanumber\n8,eight\n,nokey,1\n")
    pq.write_table(pa.table({"name": ["x"], "qty": [1.0]}), z / "c.parquet")  # no key column
    (z / "d.parquet").write_bytes(b"garbage, not parquet")  # unreadable
    (z / "e.jsonl.gz").write_bytes(b"not gzip at all")  # unreadable
    pq.write_table(pa.table({"id": pa.array([9, 10], pa.int64()), "qty": pa.array(["1", "2"])}), z / "f.parquet")
    client, _ = mem_client()
    ing, s = ingest(client, z, envelope="append_only")
    got = data_state(ing, s["upper"])
    assert got == {1: ("ok", 1.5, None), 5: ("ok5", 2.0, None), 6: ("six", 6.5, None)}
    errs = {(tuple(json.loads(e["address"]))): (e["kind"], e["reason"]) for e in errors_of(ing, s["upper"])}
    assert errs[("a.jsonl", 1)][0] == "invalid_json"
    assert errs[("a.jsonl", 2)][0] == "type_mismatch" and "id" in errs[("a.jsonl", 2)][1]
    assert errs[("a.jsonl", 3)][0] == "missing_key" and "'id'" in errs[("a.jsonl", 3)][1]
    assert errs[("a.jsonl", 4)][0] == "not_an_object"
    assert errs[("b.csv", 1)][0] == "type_mismatch" and "qty" in errs[("b.csv", 1)][1]
    assert errs[("b.csv", 2)][0] == "wrong_field_count"
    assert errs[("b.csv", 3)][0] == "missing_key"
    assert errs[("c.parquet", 0)][0] == "schema_mismatch" and "'id'" in errs[("c.parquet", 0)][1]
    assert errs[("d.parquet", 0)][0] == "unreadable_file"
    assert errs[("e.jsonl.gz", 0)][0] == "unreadable_file" and "gzip" in errs[("e.jsonl.gz", 0)][1]
    assert errs[("f.parquet", 0)][0] == "schema_mismatch" and "qty" in errs[("f.parquet", 0)][1]
    assert len(errs) == s["errors"] == 11
    # the raw bytes of a bad line are kept with its error
    raw = {tuple(json.loads(e["address"])): e["raw"] for e in errors_of(ing, s["upper"])}
    assert raw[("a.jsonl", 1)] == b'{"id": 2, "name": '
    ing.close()


def test_blank_lines_are_no_records_in_the_run_summary(tmp_path: Path) -> None:
    """docs/ingestion.md: a blank JSON line (empty or whitespace only) is no record -- its
    line number still counts as an address -- and neither is a blank CSV line: the run
    summary and the progress events count only the records, with bindings cut anywhere."""
    z = tmp_path / "z"
    z.mkdir()
    (z / "a.jsonl").write_text('{"id": 1, "name": "a"}\n\n   \n{"id": 2, "name": "b"}\n\t\r\n{"id": 3}\n\n')
    (z / "b.jsonl").write_text('\n\n{"id": 4, "name": "d"}')  # blank first, no final newline
    (z / "c.csv").write_text("id,name,qty\n5,five,1\n\n6,six,2\n")
    (z / "d.jsonl").write_text("\n \n")  # nothing but blank lines
    for n in (1, 2, 100):
        client, _ = mem_client()
        events: list[Any] = []
        ing, s = ingest(client, z, envelope="append_only", n=n, progress=events.append)
        assert set(data_state(ing, s["upper"])) == {1, 2, 3, 4, 5, 6}
        assert s["errors"] == 0 and errors_of(ing, s["upper"]) == []
        assert s["records"] == 6, (n, s["records"])
        assert events[-1].records == 6
        ing.close()


def test_late_file_is_reported_not_ingested(tmp_path: Path) -> None:
    z = tmp_path / "z"
    z.mkdir()
    (z / "b.jsonl").write_text('{"id": 1, "name": "b"}\n')
    (z / "c.jsonl").write_text('{"id": 2, "name": "c"}\n')
    client, _ = mem_client()
    ing, s1 = ingest(client, z, envelope="append_only")
    assert s1["late_files"] == []
    (z / "a.jsonl").write_text('{"id": 3, "name": "late"}\n')  # sorts before the frontier
    (z / "d.jsonl").write_text('{"id": 4, "name": "d"}\n')
    s2 = ing.run_once()
    assert s2["late_files"] == ["a.jsonl"]
    assert set(data_state(ing, s2["upper"])) == {1, 2, 4}
    errs = errors_of(ing, s2["upper"])
    assert [(json.loads(e["address"]), e["kind"]) for e in errs] == [(["a.jsonl", 0], "late_file")]
    assert "rename" in errs[0]["reason"]
    s3 = ing.run_once()  # reported once, not again
    assert s3["late_files"] == [] and len(errors_of(ing, s3["upper"])) == 1
    ing.close()


def test_files_arriving_between_runs_and_deletes(tmp_path: Path) -> None:
    z = tmp_path / "z"
    z.mkdir()
    client, _ = mem_client()
    (z / "001.jsonl").write_text('{"id": 1, "name": "a"}\n{"id": 2, "name": "b"}\n')
    ing, s = ingest(client, z)
    assert data_state(ing, s["upper"]) == {1: ("a", None, None), 2: ("b", None, None)}
    first_upper = s["upper"]
    (z / "002.jsonl").write_text('{"id": 1, "_deleted": true}\n{"id": 2, "name": "B", "qty": 3}\n')
    s = ing.run_once()
    assert data_state(ing, s["upper"]) == {2: ("B", 3.0, None)}
    # the output retracted the previous values at the new time
    data = ing._outs["data"]
    assert isinstance(data, ShardOutput)
    ups = data._r.updates_between(first_upper, s["upper"]).to_pylist()
    assert sorted((u["id"], u["name"], u["diff"]) for u in ups) == [(1, "a", -1), (2, "B", 1), (2, "b", -1)]
    ing.close()


# ----- configuration errors -------------------------------------------------------------


def test_bad_configuration_is_a_typed_error_naming_the_fix(tmp_path: Path) -> None:
    client, _ = mem_client()
    with pytest.raises(IngestConfigError, match="does not exist.*mkdir"):
        Ingestion(client, "x", LandingZoneSource(str(tmp_path / "nope")), KEY, VAL).run_once()
    with pytest.raises(IngestConfigError, match="unsupported landing zone URI scheme 'ftp'"):
        LandingZoneSource("ftp://host/dir")
    with pytest.raises(IngestConfigError, match="unknown file format 'xml'"):
        LandingZoneSource(str(tmp_path), format="xml")
    with pytest.raises(IngestConfigError, match="no key column"):
        Ingestion(client, "x", LandingZoneSource(str(tmp_path)), pa.schema([]), VAL)
    with pytest.raises(IngestConfigError, match="no key column"):
        DecodeSpec(pa.schema([]), VAL)
    with pytest.raises(IngestConfigError, match="ingestion name"):
        Ingestion(client, "bad name!", LandingZoneSource(str(tmp_path)), KEY, VAL)
    with pytest.raises(IngestConfigError, match="only makes sense with the upsert envelope"):
        Ingestion(client, "x", LandingZoneSource(str(tmp_path)), KEY, VAL, delete_field="_d")
    with pytest.raises(IngestConfigError, match="unknown envelope"):
        Ingestion(client, "x", LandingZoneSource(str(tmp_path)), KEY, VAL, envelope="debezium")
    with pytest.raises(IngestConfigError, match="reserved"):
        DecodeSpec(KEY, pa.schema([("ts", pa.int64())]))
    with pytest.raises(IngestConfigError, match="no bucket"):
        LandingZoneSource("s3:///prefix")
    with pytest.raises(IngestConfigError, match="max_records_per_binding"):
        IngestConfig(max_records_per_binding=0)
    (tmp_path / "f").write_text("")
    with pytest.raises(IngestConfigError, match="not a directory"):
        LandingZoneSource(str(tmp_path / "f")).check()


@pytest.mark.s3
def test_missing_s3_bucket_is_a_config_error(s3_endpoint: str) -> None:
    src = LandingZoneSource(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/in?endpoint_url={s3_endpoint}&region=us-east-1")
    with pytest.raises(IngestConfigError, match="does not exist"):
        src.check()


# ----- instances that disagree ------------------------------------------------------------


def test_a_different_pipeline_replaying_committed_times_needs_a_new_rendition(tmp_path: Path) -> None:
    zone = make_zone(tmp_path / "z", seed=4, files=4, rows=20)
    client, _ = mem_client()
    a, sa = ingest(client, zone.path, n=30)
    before = data_state(a, sa["upper"])
    a.close()
    # Same logic, now keeping the raw collection: it replays from 0 (the raw output is
    # new) and every committed range checks equal.
    b, sb = ingest(client, zone.path, n=30, config=IngestConfig(max_records_per_binding=30, keep_raw=True))
    assert sb["resumed_at"] == 0 and sb["appends_verified"] > 0 and sb["upper"] == sa["upper"]
    b.close()

    def upper_names(t: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        return t.set_column(t.schema.get_field_index("name"), "name", pc.utf8_upper(t["name"]))

    # Changed logic replaying committed times: refused, nothing overwritten.
    c = Ingestion(
        client, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, envelope="upsert", delete_field=DELETE,
        config=IngestConfig(max_records_per_binding=30, keep_raw=True), clock=lambda: 1, transform=upper_names,
    )
    # the raw output is complete now, so force a replay with another extra output: a
    # fresh name for the state would be a different ingestion; instead use an
    # outputs factory whose raw shard is new
    c.outputs_factory = _RenamedRole(ShardOutputs(client, "ing"), "raw", "raw2")
    with pytest.raises(NeedsNewRendition, match="new rendition") as ei:
        c.run_once()
    assert "ing/data" in str(ei.value)
    c.close()
    check = Ingestion(client, "ing", LandingZoneSource(str(zone.path)), KEY, VAL, envelope="upsert", delete_field=DELETE)
    check._open()
    assert data_state(check, sa["upper"]) == before
    check.close()


class _RenamedRole:
    """An outputs factory that stores ``role`` under another shard (forces a replay)."""

    def __init__(self, inner: ShardOutputs, role: str, as_role: str) -> None:
        self.inner, self.role, self.as_role = inner, role, as_role

    def open(self, role: str, k: pa.Schema, v: pa.Schema) -> Output:
        out = self.inner.open(self.as_role if role == self.role else role, k, v)
        out.role = role
        return out

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


# ----- injected crashes between the appends of one binding ------------------------------


class _Crash(Exception):
    pass


class _CrashingOutputs:
    """Raises before the ``crash_at``-th output append of a flush (counted over every
    output): the driver hands each output's updates over (``shard_pieces``) one output
    after the other before it commits them all as one transaction."""

    def __init__(self, inner: OutputFactory, crash_at: int) -> None:
        self.inner, self.crash_at, self.count = inner, crash_at, 0

    def open(self, role: str, k: pa.Schema, v: pa.Schema) -> Output:
        out = self.inner.open(role, k, v)
        parent = self
        orig = out.shard_pieces

        def shard_pieces(updates: pa.Table) -> list:
            parent.count += 1
            if parent.count == parent.crash_at:
                raise _Crash(f"injected crash before append #{parent.count} ({role})")
            return orig(updates)

        out.shard_pieces = shard_pieces  # type: ignore[method-assign]
        return out

    def describe(self) -> dict[str, Any]:
        return {}


def test_crash_between_the_appends_of_a_binding_resumes_definitely(tmp_path: Path) -> None:
    zone = make_zone(tmp_path / "z", seed=9, files=6, rows=20)
    ref_client, ref = mem_client()
    r, sr = ingest(ref_client, zone.path, name="crashy", n=15)
    r.close()
    client, loc = mem_client()
    crashes = 0
    for _ in range(200):
        # each run gets one flush (3 appends) through, then dies before the data (4),
        # errors (5) or state (6) append of the next binding
        crash_at = 4 + crashes % 3
        ing = Ingestion(
            client, "crashy", LandingZoneSource(str(zone.path)), KEY, VAL, envelope="upsert", delete_field=DELETE,
            config=IngestConfig(max_records_per_binding=15), clock=lambda: 1,
            outputs=_CrashingOutputs(ShardOutputs(client, "crashy"), crash_at),
        )
        try:
            s = ing.run_once()
            break
        except _Crash:
            crashes += 1
        finally:
            ing.close()
    assert crashes >= 5
    assert s["upper"] == sr["upper"]
    compare_locations(ref, loc, "crashy", ROLES)


def test_bound_file_deleted_before_its_output_was_written_is_source_data_gone(tmp_path: Path) -> None:
    z = tmp_path / "z"
    z.mkdir()
    (z / "a.jsonl").write_text('{"id": 1, "name": "a"}\n')
    client, _ = mem_client()
    ing = Ingestion(
        client, "g", LandingZoneSource(str(z)), KEY, VAL, clock=lambda: 1,
        outputs=_CrashingOutputs(ShardOutputs(client, "g"), 1),  # dies after minting, before any append
    )
    with pytest.raises(_Crash):
        ing.run_once()
    ing.close()
    (z / "a.jsonl").unlink()
    again = Ingestion(client, "g", LandingZoneSource(str(z)), KEY, VAL, clock=lambda: 1)
    with pytest.raises(SourceDataGone, match="no longer exists"):
        again.run_once()
    again.close()


# ----- STORAGE collections, S3, progress, continuous mode ---------------------------------


def test_storage_collections_as_outputs(tmp_path: Path) -> None:
    from persist_lib.storage import StorageController

    zone = make_zone(tmp_path / "z", seed=2, files=4, rows=25)
    client, _ = mem_client()
    ctl = StorageController(client)
    ing, s = ingest(client, zone.path, name="orders", outputs=StorageOutputs(ctl, "orders", num_shards=3))
    assert set(ctl.list_collections()) >= {"orders", "orders.errors", "orders.state"}
    r = ctl.acquire_read_handle("orders")
    snap = r.snapshot(s["upper"] - 1).to_pylist()
    assert {row["id"]: (row["name"], row["qty"], row["tag"]) for row in snap} == zone.final
    assert ctl.describe("orders")["renditions"]["r0"]["num_shards"] == 3
    r.expire()
    # a restart (second instance) on the collections resumes and verifies
    ing.close()
    ing2, s2 = ingest(client, zone.path, name="orders", outputs=StorageOutputs(ctl, "orders", num_shards=3))
    assert s2["resumed_at"] == s["upper"] and s2["records"] == 0
    ing2.close()


@pytest.mark.s3
def test_s3_landing_zone(s3_server: Any) -> None:
    import boto3

    bucket = s3_server.create_bucket()
    ep = s3_server.endpoint
    s3 = boto3.client("s3", endpoint_url=ep, region_name="us-east-1")
    s3.put_object(Bucket=bucket, Key="in/2024/a.jsonl", Body=b'{"id": 1, "name": "a"}\n{"id": 2, "name": "b"}\n')
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array([3], pa.int64()), "name": ["c"]}), buf)
    s3.put_object(Bucket=bucket, Key="in/2024/b.parquet", Body=buf.getvalue())
    s3.put_object(Bucket=bucket, Key="in/2024/_tmp.jsonl", Body=b"ignored")
    s3.put_object(Bucket=bucket, Key="in/2024/c.csv", Body=b"id,name\n4,d\nx,bad\n")
    client, _ = mem_client()
    src = LandingZoneSource(f"s3://{bucket}/in?endpoint_url={ep}&region=us-east-1")
    ing = Ingestion(client, "s3ing", src, KEY, VAL, clock=lambda: 1)
    s = ing.run_once()
    assert set(data_state(ing, s["upper"])) == {1, 2, 3, 4}
    assert [json.loads(e["address"]) for e in errors_of(ing, s["upper"])] == [["2024/c.csv", 1]]
    ing.close()


def test_progress_events_and_bar(tmp_path: Path) -> None:
    zone = make_zone(tmp_path / "z", seed=5, files=4, rows=30, malformed=False)
    client, _ = mem_client()
    log = ProgressLog()
    ing, s = ingest(client, zone.path, n=20, progress=log)
    ev = log.events
    assert ev and ev[-1].done and not any(e.done for e in ev[:-1])
    assert [e.records for e in ev] == sorted(e.records for e in ev)
    assert ev[-1].records == s["records"] == zone.records
    assert ev[-1].lag_bytes == 0 and ev[-1].fraction == 1.0
    out = io.StringIO()
    ProgressBar(out, min_interval_s=0)(ev[-1])
    assert "100.0%" in out.getvalue() and "rec/s" in out.getvalue()
    assert ev[-1].as_metadata()["records"] == s["records"]
    ing._heartbeat(every_s=0)  # leases extended by hand on clients without background heartbeats
    ing.close()


def test_since_follows_in_steps_and_large_appends_are_written_unsorted(tmp_path: Path) -> None:
    """The since of every output and the remap trails ``upper - 1 - since_window_ms`` by
    less than a step (1/64 of the window), never ahead of it; appends of at least
    ``unsorted_min_bytes`` are unsorted parts (``None``: the client's setting, sorted
    here), and the collection reads back the same either way."""
    import functools
    import itertools

    zone = make_zone(tmp_path / "z", seed=3, files=8, rows=30)
    got = {}
    for uns in (0, None):
        client, _ = mem_client()
        cfg = IngestConfig(max_records_per_binding=20, since_window_ms=640, unsorted_min_bytes=uns)
        ing, s = ingest(client, zone.path, config=cfg, clock=functools.partial(next, itertools.count(10_000, 7)))
        ideal = s["upper"] - 1 - 640
        assert s["bindings_applied"] > 10 and ideal > 0
        shards = [o.shard_id for o in ing._outs.values()] + [ing.remap.shard_id]  # type: ignore[attr-defined]
        for o in [*ing._outs.values(), ing.remap]:
            since = o._r.since.time  # type: ignore[union-attr]
            assert ideal - 640 // 64 < since <= ideal, (o, since, ideal)
        parts = [p for sid in shards[:1] for _, b in client.machine(sid).fetch_latest().trace_batches() for p in b.parts]
        assert parts and all(p.sorted != (uns == 0) for p in parts), [p.sorted for p in parts]
        got[uns] = data_state(ing, s["upper"])
        ing.close()
        client.close()
    assert got[0] == got[None] == zone.final


def test_continuous_mode_follows_new_files_and_advances_time(tmp_path: Path) -> None:
    z = tmp_path / "z"
    z.mkdir()
    (z / "001.jsonl").write_text('{"id": 1, "name": "a"}\n')
    client, _ = mem_client()
    now = [1000]
    ing = Ingestion(
        client, "cont", LandingZoneSource(str(z)), KEY, VAL, clock=lambda: now[0],
        config=IngestConfig(poll_interval_s=0.05),
    )
    stop = threading.Event()
    result: dict[str, Any] = {}
    th = threading.Thread(target=lambda: result.update(ing.run(stop=stop)))
    th.start()
    try:
        import time

        deadline = time.monotonic() + 20
        while ing._t < 1001 and time.monotonic() < deadline:
            time.sleep(0.02)
        (z / "002.jsonl").write_text('{"id": 2, "name": "b"}\n')
        now[0] = 2000
        while ing._t <= 2000 and time.monotonic() < deadline:
            time.sleep(0.02)
        now[0] = 3000  # no new data: the upper still follows the clock
        while ing._t <= 3000 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        th.join(30)
    assert result["upper"] > 3000 and result["records"] == 2
    assert set(data_state(ing, result["upper"])) == {1, 2}
    ing.close()
