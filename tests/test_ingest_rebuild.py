"""Rebuilding outputs from the raw collection with fixed decoding logic: the rebuilt
outputs equal, time by time, what a correct ingestion would have written; the rebuild
resumes after crashes; a STORAGE rendition rebuilt this way can be handed over to."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import (
    IngestConfig,
    Ingestion,
    LandingZoneSource,
    ShardOutputs,
    StorageOutputs,
)
from persist_lib.ingest.rebuild import rebuild_from_raw, rebuild_rendition
from tests.test_ingest_files import _Crash, _CrashingOutputs
from tests.test_ingest_support import DELETE, KEY, VAL, make_zone, shard_history


def _client() -> PersistClient:
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())


def buggy(t: pa.Table) -> pa.Table:
    """A decoding 'bug': names upper-cased."""
    return t.set_column(t.schema.get_field_index("name"), t.schema.field("name"), pc.utf8_upper(t["name"]))


def _ingest(client: PersistClient, zone: Path, name: str, **kw: Any) -> dict[str, Any]:
    with Ingestion(
        client, name, LandingZoneSource(str(zone)), KEY, VAL, envelope="upsert", delete_field=DELETE,
        config=IngestConfig(max_records_per_binding=20, keep_raw=kw.pop("keep_raw", True)), clock=lambda: 1, **kw,
    ) as ing:
        return ing.run_once()


def _decode_errors(client: PersistClient, name: str) -> dict[int, Any]:
    h = shard_history(client, name, "errors")
    # errors that came from remap notes or unreadable files have no raw record
    return {t: {k for k in c if k[2] not in ("unreadable_file",)} for t, c in h.at.items()}


def test_rebuild_with_fixed_logic_equals_a_correct_ingestion(tmp_path: Path) -> None:
    zone = make_zone(tmp_path / "z", seed=21, files=6, rows=25)
    client = _client()
    _ingest(client, zone.path, "ref", keep_raw=False)  # what correct logic writes
    s = _ingest(client, zone.path, "live", transform=buggy)
    assert shard_history(client, "live", "data").at != shard_history(client, "ref", "data").at
    out = rebuild_from_raw(
        client, "live", KEY, VAL, outputs=ShardOutputs(client, "fixed"), envelope="upsert", delete_field=DELETE,
        bindings_per_read=4,
    )
    assert out["upper"] == s["upper"] and out["resumed_at"] == 0
    for role in ("data", "state"):
        assert shard_history(client, "fixed", role).at == shard_history(client, "ref", role).at, role
    assert _decode_errors(client, "fixed") == _decode_errors(client, "ref")
    # rerunning is a no-op (resumes at the upper)
    again = rebuild_from_raw(client, "live", KEY, VAL, outputs=ShardOutputs(client, "fixed"), envelope="upsert", delete_field=DELETE)
    assert again["resumed_at"] == s["upper"] and again["records"] == 0


def test_rebuild_resumes_after_crashes(tmp_path: Path) -> None:
    zone = make_zone(tmp_path / "z", seed=22, files=6, rows=30)
    client = _client()
    _ingest(client, zone.path, "live")
    rebuild_from_raw(client, "live", KEY, VAL, outputs=ShardOutputs(client, "clean"), envelope="upsert", delete_field=DELETE)
    crashes = 0
    for _ in range(100):
        try:
            rebuild_from_raw(
                client, "live", KEY, VAL, envelope="upsert", delete_field=DELETE, bindings_per_read=1,
                outputs=_CrashingOutputs(ShardOutputs(client, "crashy"), 4 + crashes % 3),
            )
            break
        except _Crash:
            crashes += 1
    assert crashes >= 3
    for role in ("data", "errors", "state"):
        assert shard_history(client, "crashy", role).at == shard_history(client, "clean", role).at, role


def test_storage_rendition_rebuilt_from_raw_and_handed_over(tmp_path: Path) -> None:
    from persist_lib.storage import StorageController

    zone = make_zone(tmp_path / "z", seed=23, files=4, rows=20)
    client = _client()
    ctl = StorageController(client)
    _ingest(client, zone.path, "ref", keep_raw=False)
    now = [1]

    def run(rendition: str | None, **kw: Any) -> dict[str, Any]:
        with Ingestion(
            client, "orders", LandingZoneSource(str(zone.path)), KEY, VAL, envelope="upsert", delete_field=DELETE,
            outputs=StorageOutputs(ctl, "orders", num_shards=2, rendition=rendition),
            config=IngestConfig(max_records_per_binding=20, keep_raw=True), clock=lambda: now[0], **kw,
        ) as ing:
            return ing.run_once()

    s = run(None, transform=buggy)  # r0, with the bug
    u = s["upper"]
    out = rebuild_rendition(ctl, client, "orders", "r1", KEY, VAL, num_shards=3, envelope="upsert", delete_field=DELETE)
    assert out["upper"] == u
    # keep ingesting into r1 with the fixed logic (time moves on), then hand over at u
    now[0] = u + 10
    run("r1")
    for c in ("orders", "orders.errors", "orders.state"):
        ctl.handover(c, to="r1", at=u)
    r = ctl.acquire_read_handle("orders")
    ref = shard_history(client, "ref", "data").at[u - 1]
    snap = r.snapshot(u)
    got = {(x["id"], x["name"], x["qty"], x["tag"]): x["diff"] for x in snap.to_pylist()}
    assert got == dict(ref)
    before = {(x["id"], x["name"], x["qty"], x["tag"]): x["diff"] for x in r.snapshot(u - 1).to_pylist()}
    assert before != dict(ref) and all(n == n.upper() for (_, n, _, _) in before if n)
    r.expire()


@pytest.mark.parametrize("fmt", ["jsonl", "csv-json", "parquet-json", "pgoutput-json"])
def test_decode_raw_formats(fmt: str) -> None:
    import json

    from persist_lib.ingest.decode import DecodeSpec
    from persist_lib.ingest.rebuild import decode_raw

    spec = DecodeSpec(KEY, VAL)
    if fmt in ("jsonl", "parquet-json"):
        raws = [b'{"id": 1, "name": "a"}', b'{"id": "bad"}']
    elif fmt == "csv-json":
        raws = [json.dumps({"h": ["id", "name"], "f": ["1", "a"]}).encode(), json.dumps({"h": ["id", "name"], "f": ["x", "b"]}).encode()]
    else:
        raws = [
            json.dumps({"values": {"id": "1", "name": "a"}, "delete": False, "truncate": False, "unchanged": None}).encode(),
            json.dumps({"values": {"id": "zz"}, "delete": False, "truncate": False, "unchanged": None}).encode(),
        ]
    t = pa.table({
        "partition": ["p", "p"], "address": ["[0]", "[1]"], "format": [fmt, fmt], "raw": pa.array(raws, pa.binary()),
        "ts": [5, 5], "diff": [1, 1],
    })
    rows, errs = decode_raw(spec, t)
    assert rows.column("id").to_pylist() == [1] and rows.column("name").to_pylist() == ["a"]
    assert [(e.address, e.kind) for e in errs] == [((1,), "type_mismatch")]
