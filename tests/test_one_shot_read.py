"""``PersistClient.snapshot``: a snapshot without a registered reader (issue 28, cold
time travel). It writes nothing to consensus, returns what a leased reader returns,
and when a merge and GC collect the parts it is reading it starts over on the newer
state — or fails with ``SincePassed`` once the since has passed its as-of, never with
wrong rows."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUsage, SchemaMismatch, SincePassed
from persist_lib.handles import maintenance as mn
from persist_lib.location.file_blob import FileBlob
from persist_lib.location.sqlite_consensus import SqliteConsensus
from persist_lib.shard.machine import clear_state_cache

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
CFG = {"blob_target_size": 4096, "inline_threshold": 0, "rollup_interval": 8, "compaction_enabled": False}


class HookBlob(FileBlob):
    """A real ``FileBlob`` that runs ``hook`` once, before the first fetch of a part
    (a key other than a rollup's): the moment a read has picked its state version."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hook: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        if "/rollup/" not in key:
            with self._lock:
                hook, self.hook = self.hook, None
                if hook is not None:
                    hook()
        return super().get(key)


def contents(table: pa.Table) -> dict[tuple[int, str], int]:
    c: Counter[tuple[int, str]] = Counter()
    for r in table.to_pylist():
        c[(r["k"], r["v"])] += r["diff"]
    return {k: v for k, v in c.items() if v}


def client_on(d: Path) -> tuple[PersistClient, HookBlob]:
    blob = HookBlob(d / "blob")
    cons = SqliteConsensus(d / "consensus.db")
    return PersistClient(blob, cons, PersistConfig.for_tests(**CFG)), blob


def write(w, lo: int, hi: int) -> None:  # type: ignore[no-untyped-def]
    for t in range(lo, hi):
        rows = [(((i,), (f"v{t % 3}",)), t, 1 if (t + i) % 4 else -1) for i in range(200)]
        w.compare_and_append(rows, t, t + 1)


def test_equals_a_leased_snapshot_and_writes_nothing(tmp_path: Path) -> None:
    writer, _ = client_on(tmp_path)
    shard = ShardId.new()
    w, r = writer.open(shard, KEY, VAL)
    write(w, 0, 12)
    mn.compact(writer, shard)
    expected = {t: contents(r.snapshot(t)) for t in (0, 5, 11)}
    filtered = r.snapshot(5, columns=["k"], filter=[("k", "<", 50)])
    head = writer.consensus.head(str(shard))
    clear_state_cache()  # a new process
    reader, _ = client_on(tmp_path)
    for t, want in expected.items():
        assert contents(reader.snapshot(shard, KEY, VAL, t)) == want
    got = reader.snapshot(shard, KEY, VAL, 5, columns=["k"], filter=[("k", "<", 50)])
    assert got.column_names == filtered.column_names
    assert sorted(got.to_pylist(), key=str) == sorted(filtered.to_pylist(), key=str)
    assert reader.consensus.head(str(shard)) == head, "a one-shot read wrote to consensus"
    reader.close()
    writer.close()


def test_as_of_before_the_since_is_since_passed(tmp_path: Path) -> None:
    client, _ = client_on(tmp_path)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    write(w, 0, 12)
    r.downgrade_since(8)
    mn.compact(client, shard)  # forwards times before 8 to 8
    clear_state_cache()
    c2, _ = client_on(tmp_path)
    with pytest.raises(SincePassed, match="since"):
        c2.snapshot(shard, KEY, VAL, 2)
    assert contents(c2.snapshot(shard, KEY, VAL, 8)) == contents(r.snapshot(8))
    c2.close()
    client.close()


def _collect_during_read(
    tmp_path: Path, *, since: int | None
) -> tuple[PersistClient, PersistClient, ShardId, dict[tuple[int, str], int]]:
    """A shard of 12 uncompacted commits; the reader's first part fetch (its state
    version picked) first runs, through another client: optionally a since downgrade,
    a merge of every batch and a GC that deletes the merged parts."""
    owner, _ = client_on(tmp_path)
    shard = ShardId.new()
    w, r = owner.open(shard, KEY, VAL)
    write(w, 0, 12)
    expected = contents(r.snapshot(4))
    reader, hook_blob = client_on(tmp_path)
    reader.machine(shard).fetch_latest()  # the state version the read will pick

    def compact_and_collect() -> None:
        if since is not None:
            r.downgrade_since(since)
        mn.compact(owner, shard)
        r.heartbeat()  # its seqno hold moves past the merge: the old parts are garbage
        res = mn.gc(owner, shard)
        assert res["blobs_deleted"] > 0, res

    hook_blob.hook = compact_and_collect
    return owner, reader, shard, expected


def test_parts_collected_during_the_read_start_it_over(tmp_path: Path) -> None:
    owner, reader, shard, expected = _collect_during_read(tmp_path, since=None)
    assert contents(reader.snapshot(shard, KEY, VAL, 4)) == expected
    assert reader.machine(shard).cached().seqno > 0
    reader.close()
    owner.close()


def test_since_passing_the_as_of_during_the_read_is_since_passed(tmp_path: Path) -> None:
    owner, reader, shard, _ = _collect_during_read(tmp_path, since=9)
    with pytest.raises(SincePassed, match="as of 4"):
        reader.snapshot(shard, KEY, VAL, 4)
    reader.close()
    owner.close()


def test_never_creates_a_shard_and_checks_schemas(tmp_path: Path) -> None:
    client, _ = client_on(tmp_path)
    with pytest.raises(InvalidUsage, match="does not exist"):
        client.snapshot(ShardId.new(), KEY, VAL, 0)
    assert client.list_shards() == []
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    write(w, 0, 2)
    with pytest.raises(SchemaMismatch):
        client.snapshot(shard, KEY, pa.schema([("v", pa.int64())]), 1)
    client.close()
