"""Schema evolution of a STORAGE collection (issue 27 item 3): the catalog's schemas and
every shard of every live rendition, crash-safe; stale writers and readers refused."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import IncompatibleSchemaChange, InvalidUsage, StaleSchema
from persist_lib.shard.codec import Schemas
from persist_lib.storage import StorageController
from persist_lib.storage.schema_evolution import EVOLVING

K = pa.schema([pa.field("k", pa.int64(), nullable=False)])
V1 = pa.schema([("a", pa.int32())])
V2 = pa.schema([("a", pa.int32()), ("b", pa.string())])
V3 = pa.schema([("a", pa.int64()), ("b", pa.string())])


def mem_client() -> PersistClient:
    n = uuid.uuid4().hex
    return PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests())


def rows(table: pa.Table) -> set[tuple[Any, ...]]:
    return {tuple(r.values()) for r in table.to_pylist()}


def shard_ids(ctl: StorageController, name: str) -> list[str]:
    d = ctl.describe(name)
    return [s for r in d["renditions"].values() for s in r["shards"]]


def heads(ctl: StorageController, name: str) -> dict[str, bytes | None]:
    ids = [str(ctl.catalog.shard), *shard_ids(ctl, name)]
    out = {}
    for s in ids:
        h = ctl.client.raw_consensus.head(s)
        out[s] = None if h is None else h.data
    return out


def build(ctl: StorageController) -> None:
    """r0 (2 shards) at 0, handed over at 1 to r1 (3 shards); v1 rows at 0; evolved to v2
    (b added) with rows at 1 and 2; evolved to v3 (a widened) with rows at 3."""
    ctl.create_collection("c", K, V1, num_shards=2)
    w0 = ctl.open_writer("c")
    w0.append([(((k,), (k,)), 0, 1) for k in range(6)], 0, 1)
    ctl.create_rendition("c", "r1", 3)
    w1 = ctl.open_writer("c", "r1")
    w1.append([(((k,), (k,)), 0, 1) for k in range(6)], 0, 1)
    w1.append([], 1, 2)
    ctl.handover("c", to="r1", at=1)
    w0.expire()
    res = ctl.evolve_schema("c", K, V2)
    assert res["version"] == 1 and res["changes"] == ["add b: string"]
    assert res["shards_evolved"] == 5  # both renditions: r0 still serves times before 1
    # The writer opened before the evolution is refused; nothing is written.
    with pytest.raises(StaleSchema, match="evolved to version 1"):
        w1.append([(((9,), (9,)), 2, 1)], 2, 3)
    assert ctl.open_writer("c").upper == pa_upper(2)
    w = ctl.open_writer("c")
    assert w.schemas == Schemas.create(K, V2)
    w.append([(((0,), (0, None)), 2, -1), (((0,), (0, "zero")), 2, 1), (((7,), (7, "seven")), 2, 1)], 2, 3)
    assert ctl.evolve_schema("c", K, V3)["version"] == 2
    w = ctl.open_writer("c")
    w.append([(((8,), (2**35, "eight")), 3, 1)], 3, 4)
    w.expire()


def pa_upper(t: int) -> Any:
    from persist_lib.frontier import Antichain

    return Antichain([t])


def test_collection_reads_across_versions_and_renditions() -> None:
    ctl = StorageController(mem_client())
    build(ctl)
    assert ctl.describe("c")["schema_version"] == 2
    info = ctl.schema("c")
    assert [v["version"] for v in info["versions"]] == [0, 1, 2] and info["pending_version"] is None
    r = ctl.acquire_read_handle("c")
    base = {(k, k, None, 0, 1) for k in range(6)}
    assert rows(r.snapshot(0)) == base  # r0 (retired), written under v1
    at2 = {(x[0], x[1], x[2], 2, 1) for x in base if x[0] != 0} | {(0, 0, "zero", 2, 1), (7, 7, "seven", 2, 1)}
    assert rows(r.snapshot(2)) == at2
    at3 = {(x[0], x[1], x[2], 3, 1) for x in at2} | {(8, 2**35, "eight", 3, 1)}
    snap = r.snapshot(3)
    assert snap.schema.field("a").type == pa.int64()
    assert rows(snap) == at3
    listened = rows(r.listen(0).read_until(4))
    assert listened == {
        (0, 0, None, 2, -1), (0, 0, "zero", 2, 1), (7, 7, "seven", 2, 1), (8, 2**35, "eight", 3, 1)
    }
    r.expire()
    # A rendition created now starts with the collection's registry (its version ids).
    ctl.create_rendition("c", "r2", 2)
    new_shards = ctl.describe("c")["renditions"]["r2"]["shards"]
    reg = [Schemas.from_json(ctl.client.machine(s).fetch_latest().schemas or {}) for s in new_shards]
    assert [x.version for x in reg] == [2, 2] and all(x.history == reg[0].history for x in reg)
    assert [h.fingerprint() for h in reg[0].history] == [
        Schemas.create(K, V1).fingerprint(), Schemas.create(K, V2).fingerprint()
    ]


def test_an_incompatible_collection_change_changes_nothing() -> None:
    ctl = StorageController(mem_client())
    ctl.create_collection("c", K, V1, num_shards=3)
    w = ctl.open_writer("c")
    w.append([(((1,), (1,)), 0, 1)], 0, 1)
    before = heads(ctl, "c")
    for key, val in [
        (pa.schema([pa.field("k", pa.int32(), nullable=False)]), V1),
        (K, pa.schema([("a", pa.int16())])),
        (K, pa.schema([("a", pa.int32()), pa.field("n", pa.int8(), nullable=False)])),
    ]:
        with pytest.raises(IncompatibleSchemaChange, match="build a new rendition"):
            ctl.evolve_schema("c", key, val)
    assert heads(ctl, "c") == before
    w.append([(((2,), (2,)), 1, 1)], 1, 2)  # the v1 writer is unaffected
    assert ctl.evolve_schema("c", K, V1)["outcome"] == "unchanged"


def test_a_crash_between_shards_leaves_a_consistent_completable_state(monkeypatch: pytest.MonkeyPatch) -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V1, num_shards=3)
    stale = ctl.open_writer("c")
    stale.append([(((k,), (k,)), 0, 1) for k in range(9)], 0, 1)
    real = client.compare_and_evolve_schema
    calls = {"n": 0}

    def crash_after_first(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected crash between shards")
        return real(*a, **kw)

    monkeypatch.setattr(client, "compare_and_evolve_schema", crash_after_first)
    with pytest.raises(RuntimeError, match="injected crash"):
        ctl.evolve_schema("c", K, V2)
    monkeypatch.undo()
    # Left behind: the intent in the catalog, one shard at v2, two at v1.
    cat, _ = ctl.catalog.load()
    assert cat["c"][EVOLVING]["version"] == 1
    versions = [
        Schemas.from_json(client.machine(s).fetch_latest().schemas or {}).version for s in shard_ids(ctl, "c")
    ]
    assert sorted(versions) == [0, 0, 1]
    # Nobody reads or writes a mix meanwhile.
    ro = StorageController(client, read_only=True)
    with pytest.raises(StaleSchema, match="interrupted"):
        ro.acquire_read_handle("c")
    with pytest.raises(StaleSchema):
        stale.append([(((k,), (k,)), 1, 1) for k in range(9)], 1, 2)
    with pytest.raises(InvalidUsage, match="interrupted"):
        ctl.evolve_schema("c", K, V3)
    # A new controller's recovery finishes it; the same request again is a no-op.
    ctl2 = StorageController(client)
    assert ctl2.describe("c")["schema_version"] == 1
    assert EVOLVING not in ctl2.catalog.load()[0]["c"]
    assert ctl2.evolve_schema("c", K, V2)["outcome"] == "unchanged"
    r = ctl2.acquire_read_handle("c")
    assert rows(r.snapshot(0)) == {(k, k, None, 0, 1) for k in range(9)}
    w = ctl2.open_writer("c")
    w.append([(((1,), (1, "one")), 1, 1)], 1, 2)
    assert (1, 1, "one", 1, 1) in rows(r.snapshot(1))


def test_a_writable_controller_finishes_a_pending_evolution_before_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    client = mem_client()
    ctl = StorageController(client)
    ctl.create_collection("c", K, V1, num_shards=2)
    real = client.compare_and_evolve_schema

    def crash(*a: Any, **kw: Any) -> Any:
        real(*a, **kw)
        raise RuntimeError("injected crash after the first shard")

    monkeypatch.setattr(client, "compare_and_evolve_schema", crash)
    with pytest.raises(RuntimeError):
        ctl.evolve_schema("c", K, V2)
    monkeypatch.undo()
    w = ctl.open_writer("c")  # finishes the evolution first
    assert w.schemas == Schemas.create(K, V2)
    assert ctl.describe("c")["schema_version"] == 1


_KILL_CHILD = """
import os, signal, sys
import pyarrow as pa
from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController
client = PersistClient.default(sys.argv[1], PersistConfig.for_tests())
real = client.compare_and_evolve_schema
def evolve_then_die(*a, **kw):
    out = real(*a, **kw)
    os.kill(os.getpid(), signal.SIGKILL)  # right after the first shard's CAS
    return out
client.compare_and_evolve_schema = evolve_then_die
ctl = StorageController(client)
K = pa.schema([pa.field("k", pa.int64(), nullable=False)])
ctl.evolve_schema("c", K, pa.schema([("a", pa.int32()), ("b", pa.string())]))
"""


def test_a_process_killed_mid_evolve_leaves_a_completable_state(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    with StorageController(client) as ctl:
        ctl.create_collection("c", K, V1, num_shards=4)
        w = ctl.open_writer("c")
        w.append([(((k,), (k,)), 0, 1) for k in range(20)], 0, 1)
        w.expire()
    client.close()
    p = subprocess.run([sys.executable, "-c", _KILL_CHILD, str(home)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    client = PersistClient.default(home, PersistConfig.for_tests())
    ro = StorageController(client, read_only=True)
    assert ro.catalog.load()[0]["c"][EVOLVING]["version"] == 1
    versions = sorted(
        Schemas.from_json(client.machine(s).fetch_latest().schemas or {}).version for s in shard_ids(ro, "c")
    )
    assert versions == [0, 0, 0, 1]
    with pytest.raises(StaleSchema, match="interrupted"):
        ro.acquire_read_handle("c")
    with StorageController(client) as ctl:  # recovery finishes it
        assert ctl.describe("c")["schema_version"] == 1
        r = ctl.acquire_read_handle("c")
        assert rows(r.snapshot(0)) == {(k, k, None, 0, 1) for k in range(20)}
        r.expire()
    client.close()


def test_a_listener_opened_before_an_evolution_stops_typed_at_the_new_version() -> None:
    ctl = StorageController(mem_client())
    ctl.create_collection("c", K, V1, num_shards=2)
    w = ctl.open_writer("c")
    w.append([(((1,), (1,)), 0, 1)], 0, 1)
    r = ctl.acquire_read_handle("c")
    listen = r.listen(0)
    w.append([(((2,), (2,)), 1, 1)], 1, 2)
    assert rows(listen.read_until(2)) == {(2, 2, 1, 1)}  # still its version: read
    ctl.evolve_schema("c", K, V2)
    w2 = ctl.open_writer("c")
    w2.append([(((3,), (3, "x")), 2, 1)], 2, 3)
    with pytest.raises(StaleSchema, match="Reopen"):
        listen.read_until(3)
    fresh = ctl.acquire_read_handle("c")
    assert rows(fresh.listen(1).read_until(3)) == {(3, 3, "x", 2, 1)}
    for h in (w, w2, r, fresh):
        h.expire()
