"""Ingestion follows an evolved collection: new JSON and CSV fields land in the new
column, rows ingested before read null there, a stale ingestion is refused typed."""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource, StorageOutputs
from persist_lib.ingest.schema_follow import IngestSchemaStale, evolve_ingestion
from persist_lib.storage import StorageController

K = pa.schema([pa.field("id", pa.int64(), nullable=False)])
V1 = pa.schema([("name", pa.string()), ("qty", pa.int32())])
V2 = pa.schema([("name", pa.string()), ("qty", pa.int64()), ("price", pa.float64())])


def run(client: PersistClient, ctl: StorageController, zone: Path, val: pa.Schema, **kw: object) -> dict:
    ing = Ingestion(
        client, "items", LandingZoneSource(str(zone)), K, val, config=IngestConfig(),
        outputs=StorageOutputs(ctl, "items", num_shards=2), clock=lambda: 1, **kw,  # type: ignore[arg-type]
    )
    try:
        return ing.run_once()
    finally:
        ing.close()


@pytest.mark.parametrize("envelope", ["append_only", "upsert"])
def test_new_record_fields_land_in_the_evolved_column(tmp_path: Path, envelope: str) -> None:
    n = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests())
    ctl = StorageController(client)
    zone = tmp_path / "zone"
    zone.mkdir()
    # The producer already sends price; v1 has no column for it (ignored).
    (zone / "001.jsonl").write_text('{"id": 1, "name": "a", "qty": 1, "price": 9.5}\n{"id": 2, "name": "b", "qty": 2}\n')
    s1 = run(client, ctl, zone, V1, envelope=envelope)
    res = evolve_ingestion(ctl, "items", K, V2)
    assert set(res) == ({"items", "items.state"} if envelope == "upsert" else {"items"})
    (zone / "002.jsonl").write_text('{"id": 3, "name": "c", "qty": 3000000000, "price": 1.25}\n')
    (zone / "003.csv").write_text("id,name,qty,price\n4,d,4,2.5\n")
    with pytest.raises(IngestSchemaStale, match="evolved to schema version 1"):
        run(client, ctl, zone, V1, envelope=envelope)
    s2 = run(client, ctl, zone, V2, envelope=envelope)
    assert s2["records"] == 2
    r = ctl.acquire_read_handle("items")
    got = {x["id"]: (x["name"], x["qty"], x["price"]) for x in r.snapshot(s2["upper"] - 1).to_pylist()}
    assert got == {1: ("a", 1, None), 2: ("b", 2, None), 3: ("c", 3000000000, 1.25), 4: ("d", 4, 2.5)}
    before = {x["id"] for x in r.snapshot(s1["upper"] - 1).to_pylist()}
    assert before == {1, 2}
    r.expire()
    errs = ctl.acquire_read_handle("items.errors")
    assert errs.snapshot(s2["upper"] - 1).num_rows == 0
    errs.expire()


def test_an_incompatible_change_goes_through_a_rebuilt_rendition(tmp_path: Path) -> None:
    """qty int32 -> double (a change of kind) can't be made in place: refused, then rebuilt from the raw
    collection into r1 with the new schemas, ingested on, handed over."""
    from persist_lib.errors import IncompatibleSchemaChange, StaleSchema
    from persist_lib.ingest.rebuild import rebuild_rendition

    n = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests())
    ctl = StorageController(client)
    zone = tmp_path / "zone"
    zone.mkdir()
    (zone / "001.jsonl").write_text('{"id": 1, "name": "a", "qty": 1}\n{"id": 2, "name": "b", "qty": 22}\n')
    now = [1]
    vnew = pa.schema([("name", pa.string()), ("qty", pa.float64())])

    def ingest(val: pa.Schema, rendition: str | None) -> dict:
        ing = Ingestion(
            client, "items", LandingZoneSource(str(zone)), K, val, envelope="upsert", delete_field="_d",
            config=IngestConfig(keep_raw=True),
            outputs=StorageOutputs(ctl, "items", num_shards=2, rendition=rendition), clock=lambda: now[0],
        )
        try:
            return ing.run_once()
        finally:
            ing.close()

    u = ingest(V1, None)["upper"]
    before = {c: ctl.catalog.load()[0][c] for c in ("items", "items.state")}
    with pytest.raises(IncompatibleSchemaChange, match="build a new rendition"):
        ctl.evolve_schema("items", K, vnew)
    assert {c: ctl.catalog.load()[0][c] for c in ("items", "items.state")} == before
    old_reader = ctl.acquire_read_handle("items")
    out = rebuild_rendition(ctl, client, "items", "r1", K, vnew, num_shards=3, envelope="upsert", delete_field="_d")
    assert out["upper"] == u
    assert ctl.describe("items")["renditions"]["r1"]["schemas"] == "key(id: int64 not null) val(name: string, qty: double)"
    (zone / "002.jsonl").write_text('{"id": 3, "name": "c", "qty": 3.5}\n')
    now[0] = u + 10
    assert ingest(vnew, "r1")["records"] == 1
    for c in ("items", "items.errors", "items.state"):
        ctl.handover(c, to="r1", at=u)
    assert ctl.describe("items")["schemas"] == "key(id: int64 not null) val(name: string, qty: double)"
    r = ctl.acquire_read_handle("items")
    assert {(x["id"], x["name"], x["qty"]) for x in r.snapshot(u).to_pylist()} == {(1, "a", 1.0), (2, "b", 22.0)}
    with pytest.raises(StaleSchema, match="before a handover to a rendition rebuilt"):
        r.snapshot(u - 1)
    with pytest.raises(StaleSchema):
        old_reader.snapshot(u)
    assert {(x["id"], x["qty"]) for x in old_reader.snapshot(u - 1).to_pylist()} == {(1, 1), (2, 22)}
    w = ctl.open_writer("items")
    assert w.rendition == "r1" and w.schemas.val == vnew
    # The retired rendition keeps its schemas; an in-place change now evolves r1 only.
    res = ctl.evolve_schema("items", K, pa.schema([("name", pa.string()), ("qty", pa.float64()), ("p", pa.float64())]))
    assert res["shards_evolved"] == 3
    assert ctl.describe("items")["renditions"]["r0"]["schemas"] == "key(id: int64 not null) val(name: string, qty: int32)"
    for h in (w, r, old_reader):
        h.expire()
