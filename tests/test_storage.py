"""STORAGE: collections, renditions, handover, the collection reader, deletion."""

from __future__ import annotations

import random
import uuid
from collections import Counter

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.errors import InvalidUsage
from persist_lib.handles.listen import ListenUpdates
from persist_lib.storage import CollectionDeleted, StorageController, UnknownCollection

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def mem_ctl(**cfg: object) -> StorageController:
    n = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests(**cfg))
    return StorageController(client)


def acc(table: pa.Table) -> Counter:
    c: Counter = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return +c


def test_listen_across_handovers_between_1_4_8_shard_renditions() -> None:
    ctl = mem_ctl()
    ctl.create_collection("c", K, V, num_shards=1)
    rng = random.Random(5)
    reader = ctl.acquire_read_handle("c")
    listen = reader.listen(0)
    # The "truth" per rendition: each rendition holds a different deterministic
    # function of the same input, so handovers visibly change the contents.
    def contents(rend: str, t: int) -> Counter:
        c: Counter = Counter()
        for i in range(t + 1):
            c[(i % 17, f"{rend}-{i % 5}")] += 1
        return c

    def updates(rend: str, t: int) -> list:
        return [(((t % 17,), (f"{rend}-{t % 5}",)), t, 1)]

    writers = {"r0": ctl.open_writer("c", "r0")}
    writers["r0"].append(updates("r0", 0), 0, 1)
    plan = [("r1", 4, 8), ("r2", 8, 16), ("r3", 1, 24)]  # (rendition, shards, handover time)
    t = 1
    for rend, nshards, at in plan:
        ctl.create_rendition("c", rend, nshards)
        w = writers[rend] = ctl.open_writer("c", rend)
        # backfill the new rendition up to now
        backfill = []
        for i in range(t):
            backfill.extend(updates(rend, i))
        w.append(backfill, 0, t)
        while t < at:
            for name, wr in writers.items():
                wr.append(updates(name, t), t, t + 1)
            t += 1
        w.append(updates(rend, at), at, at + 1)  # readable at the handover time
        ctl.handover("c", to=rend, at=at)
        for _ in range(rng.randint(1, 3)):
            for name, wr in writers.items():
                wr.append(updates(name, t), t, t + 1)
            t += 1
    end = t
    # Accumulate the listen output time by time; at every time it must equal the
    # snapshot, which must equal the rendition that was active then.
    seen: Counter = Counter()
    per_time: dict[int, Counter] = {0: acc(reader.snapshot(0))}
    seen.update(per_time[0])
    while listen.frontier.time is not None and listen.frontier.time < end:
        for e in listen.next(2.0):
            if isinstance(e, ListenUpdates):
                by_t: dict[int, list] = {}
                for r in e.table.to_pylist():
                    by_t.setdefault(r["ts"], []).append(r)
                for ts in sorted(by_t):
                    for r in by_t[ts]:
                        seen[(r["k"], r["v"])] += r["diff"]
                    per_time[ts] = +Counter(seen)
    timeline = ctl.describe("c")["timeline"]
    active = lambda ts: [h["to"] for h in timeline if h["at"] <= ts][-1]  # noqa: E731
    last = Counter(per_time[0])
    for ts in range(end):
        cur = per_time.get(ts, last)
        last = cur
        assert cur == acc(reader.snapshot(ts)), f"listen != snapshot at {ts}"
        assert cur == contents(active(ts), ts), f"not the active rendition at {ts}"
    assert [h["to"] for h in timeline] == ["r0", "r1", "r2", "r3"]
    shards = {r: d["num_shards"] for r, d in ctl.describe("c")["renditions"].items()}
    assert shards == {"r0": 1, "r1": 4, "r2": 8, "r3": 1}


def test_handover_refusals_change_nothing() -> None:
    ctl = mem_ctl()
    ctl.create_collection("c", K, V)
    w0 = ctl.open_writer("c")
    w0.append([(((1,), ("a",)), 0, 1)], 0, 5)
    ctl.create_rendition("c", "r1", 2)
    w1 = ctl.open_writer("c", "r1")
    w1.append([(((1,), ("a",)), 0, 1)], 0, 3)
    before = ctl.describe("c")
    with pytest.raises(InvalidUsage, match="not readable there"):
        ctl.handover("c", to="r1", at=5)
    with pytest.raises(InvalidUsage, match="below the metadata upper"):
        ctl.handover("c", to="r1", at=2)
    with pytest.raises(InvalidUsage, match="unknown rendition 'nope'"):
        ctl.handover("c", to="nope", at=7)
    with pytest.raises(InvalidUsage, match="already active"):
        ctl.handover("c", to="r0", at=7)
    with pytest.raises(UnknownCollection):
        ctl.handover("missing", to="r1", at=7)
    w1.append([], 3, 8)
    with pytest.raises(InvalidUsage, match="only complete up to"):
        ctl.handover("c", to="r1", at=6)
    assert ctl.describe("c")["timeline"] == before["timeline"]
    ctl.handover("c", to="r1", at=5)
    assert ctl.describe("c")["active_rendition"] == "r1"


def test_old_rendition_collected_after_readers_pass_and_delete_removes_everything() -> None:
    ctl = mem_ctl(inline_threshold=0)
    client = ctl.client
    ctl.create_collection("c", K, V, num_shards=2)
    w0 = ctl.open_writer("c")
    for t in range(5):
        w0.append([(((i,), (f"{t}",)), t, 1) for i in range(20)], t, t + 1)
    reader = ctl.acquire_read_handle("c")
    ctl.create_rendition("c", "r1", 4)
    w1 = ctl.open_writer("c", "r1")
    snap = reader.snapshot(4)
    w1.append(snap.set_column(snap.schema.get_field_index("ts"), "ts", pa.array([0] * len(snap), pa.int64())), 0, 6)
    ctl.handover("c", to="r1", at=5)
    w1.append([], 6, 9)  # the new rendition moves on: the metadata is decided through 8
    r0_shards = ctl.describe("c")["renditions"]["r0"]["shards"]
    r0_blobs = sum(len(list(client.blob.list_keys_and_metadata(s + "/"))) for s in r0_shards)
    assert r0_blobs > 0
    # the reader (and the controller's default hold) are still before the handover
    assert ctl.collect_renditions("c") == {}
    ctl.allow_compaction("c", 6)
    assert ctl.collect_renditions("c") == {}, "the reader still holds time <= 5"
    reader.downgrade_since(6)
    out = ctl.collect_renditions("c")
    print("collected:", out)
    assert out["c"]["r0"]["shards_finalized"] == 2 and out["c"]["r0"]["blobs_deleted"] >= r0_blobs
    assert sum(len(list(client.blob.list_keys_and_metadata(s + "/"))) for s in r0_shards) <= 2  # tombstone rollups
    assert acc(reader.snapshot(6)) == acc(snap)
    # delete: readers get a clear error, every blob of the collection goes
    desc = ctl.describe("c")
    all_shards = [desc["metadata_shard"]] + [s for r in desc["renditions"].values() for s in r["shards"]]
    res = ctl.delete_collection("c")
    print("deleted:", res)
    with pytest.raises(CollectionDeleted, match="was deleted"):
        reader.snapshot(6)
    assert "c" not in ctl.list_collections()
    leftover = [
        k.key
        for s in all_shards
        for k in client.blob.list_keys_and_metadata(s + "/")
        if "/rollup/" not in k.key
    ]
    assert leftover == []
    with pytest.raises(UnknownCollection):
        ctl.describe("c")


def test_bad_names_and_duplicates() -> None:
    ctl = mem_ctl()
    for bad in ["", "a,b", "1abc", "x" * 200, "a b", '{"x"}']:
        with pytest.raises(InvalidUsage, match="not valid"):
            ctl.create_collection(bad, K, V)
    ctl.create_collection("ok", K, V)
    with pytest.raises(InvalidUsage, match="already exists"):
        ctl.create_collection("ok", K, V)
    with pytest.raises(InvalidUsage, match="num_shards"):
        ctl.create_rendition("ok", "r9", 0)
    assert ctl.list_collections() == ["ok"]


def test_cli_collections_and_describe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = StorageController(client)
    ctl.create_collection("events", K, V, num_shards=2)
    ctl.open_writer("events").append([(((1,), ("a",)), 0, 1)], 0, 1)
    env = {**os.environ, "PERSIST_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "persist_lib.cli.main", "collections", "--json"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"name": "events", "active_rendition": "r0", "renditions": ["r0"]}]
    out = subprocess.run([sys.executable, "-m", "persist_lib.cli.main", "describe", "events", "--json"], env=env, capture_output=True, text=True)
    d = json.loads(out.stdout)
    assert d["renditions"]["r0"]["num_shards"] == 2 and d["renditions"]["r0"]["upper"] == [1]
    out = subprocess.run([sys.executable, "-m", "persist_lib.cli.main", "describe", "nope"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "does not exist" in out.stderr


def _registrations(client: PersistClient) -> dict[str, tuple[list[str], list[str], list[str]]]:
    """Every reader and writer registered on every shard of the location."""
    out = {}
    for s in client.list_shards():
        st = client.inspect(s)
        out[s] = (
            sorted(st.get("leased_readers", {})),
            sorted(st.get("writers", {})),
            sorted(st.get("critical_readers", {})),
        )
    return out


def _handed_over(client: PersistClient) -> StorageController:
    """Collection ``c``: r0 (2 shards) handed over to r1 (3 shards) at 5, decided to 8."""
    ctl = StorageController(client)
    ctl.create_collection("c", K, V, num_shards=2)
    w0 = ctl.open_writer("c")
    for t in range(5):
        w0.append([(((i,), (f"{t}",)), t, 1) for i in range(10)], t, t + 1)
    ctl.create_rendition("c", "r1", 3)
    w1 = ctl.open_writer("c", "r1")
    w1.append([(((i,), ("4",)), 0, 1) for i in range(10)], 0, 6)
    ctl.handover("c", to="r1", at=5)
    w1.append([], 6, 9)
    w0.expire()
    w1.expire()
    return ctl


def test_inspection_leaves_no_holds_so_retired_renditions_are_collected_right_after(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue defect 1: ``persist collections`` / ``persist describe`` (and every other
    read-only path) registered readers and writers they never released; a reader on the
    metadata shard kept the retired rendition from being collected for a whole lease."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests())
    ctl = _handed_over(client)
    before = _registrations(client)
    env = {**os.environ, "PERSIST_HOME": str(home)}
    meta = ctl.describe("c")["metadata_shard"]
    reads = [["collections"], ["describe", "c"], ["inspect", meta], ["shards"], ["snapshot", "c"]]
    reads += [["snapshot", "c", "--as-of", "5"], ["tail", "c", "--from", "4", "--until", "7"]]
    for args in reads + [[*a, "--json"] for a in reads]:  # tables (extra reads) and JSON
        out = subprocess.run(
            [sys.executable, "-m", "persist_lib.cli.main", *args], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
    other = StorageController(client)  # a read-write controller: describe leaves nothing
    other.describe("c")
    other.list_collections()
    other.close()  # ... and close releases the catalog writer/reader it registered
    assert _registrations(client) == before
    # a read-only controller (sensors, metadata helpers) registers nothing it keeps
    ro = StorageController(client, read_only=True)
    assert ro.list_collections() == ["c"] and ro.describe("c")["active_rendition"] == "r1"
    assert _registrations(client) == before
    with pytest.raises(InvalidUsage, match="read-only"):
        ro.handover("c", to="r0", at=9)
    # a GC pass right after: the retired rendition goes
    ctl.allow_compaction("c", 6)
    out = ctl.collect_renditions("c")
    assert out["c"]["r0"]["shards_finalized"] == 2, out
    ctl.close()


def test_describe_reports_retired_renditions_and_the_real_handover_after_compaction() -> None:
    """Issue defect 3 (describe): a retired rendition was reported ``status: ready``, and
    once the metadata shard's history was compacted the timeline lost the handover
    (``{"at": <since>, "from": null, "to": "r1"}``)."""
    n = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{n}", f"mem://{n}", PersistConfig.for_tests())
    ctl = _handed_over(client)
    expected = [{"at": 0, "from": None, "to": "r0"}, {"at": 5, "from": "r0", "to": "r1"}]
    d = ctl.describe("c")
    assert d["timeline"] == expected and d["active_rendition"] == "r1"
    assert d["renditions"]["r0"]["status"] == "retired" and d["renditions"]["r0"]["retired_at"] == 5
    assert d["renditions"]["r1"]["status"] == "active"
    assert d["renditions"]["r1"]["active"] and not d["renditions"]["r0"]["active"]
    ctl.allow_compaction("c", 6)
    ctl.collect_renditions("c")
    for c in (ctl, StorageController(client, read_only=True)):
        d = c.describe("c")
        assert d["metadata_since"] == [6]  # the handover at 5 is compacted away there
        assert d["timeline"] == expected, d["timeline"]
        assert d["renditions"]["r0"]["status"] == "dropped" and d["active_rendition"] == "r1"
    # a second handover, after the compacted part, keeps the whole chain
    ctl.create_rendition("c", "r2", 1)
    w2 = ctl.open_writer("c", "r2")
    w2.append([(((i,), ("4",)), 0, 1) for i in range(10)], 0, 10)
    ctl.handover("c", to="r2", at=9)
    assert ctl.describe("c")["timeline"] == [*expected, {"at": 9, "from": "r1", "to": "r2"}]
    ctl.allow_compaction("c", 10)
    w2.append([], 10, 12)
    ctl.allow_compaction("c", 11)
    ctl.collect_renditions("c")
    d = StorageController(client, read_only=True).describe("c")
    assert d["metadata_since"][0] > 9
    assert d["timeline"] == [*expected, {"at": 9, "from": "r1", "to": "r2"}], d["timeline"]
