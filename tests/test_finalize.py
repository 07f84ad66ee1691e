"""Finalization: a shard whose since and upper are empty is deleted, leaving a tombstone."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId
from persist_lib.errors import InvalidUsage, LeaseExpired, ShardTombstoned
from persist_lib.handles import maintenance as mn
from persist_lib.handles.read import ReadHandle
from persist_lib.handles.write import WriteHandle
from persist_lib.shard.machine import clear_state_cache

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def mem_client(**cfg: object) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, object] = {"blob_target_size": 4096, "inline_threshold": 0, "rollup_interval": 8}
    base.update(cfg)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**base))


def populated(client: PersistClient) -> tuple[ShardId, WriteHandle, ReadHandle]:
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(10):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(200)], t, t + 1)
    mn.compact(client, shard)
    client.blob.set(f"{shard}/w{uuid.uuid4()}/pleaked", b"leaked by a crashed writer")
    return shard, w, r


def test_finalize_needs_empty_since_and_upper() -> None:
    client = mem_client()
    shard, w, r = populated(client)
    with pytest.raises(InvalidUsage) as e:
        mn.finalize(client, shard)
    msg = str(e.value)
    assert "upper is [10]" in msg and "Antichain.empty()" in msg and "since is [0]" in msg
    w.compare_and_append([], 10, Antichain.empty())
    with pytest.raises(InvalidUsage) as e:
        mn.finalize(client, shard)
    assert "since" in str(e.value) and "upper" not in str(e.value).split(":", 1)[1]
    assert client.machine(shard).fetch_latest().batches  # nothing was deleted


def test_finalize_deletes_every_blob_and_leaves_a_tombstone() -> None:
    client = mem_client()
    shard, w, r = populated(client)
    w.compare_and_append([], 10, Antichain.empty())
    r.downgrade_since(Antichain.empty())
    assert len(list(client.blob.list_keys_and_metadata(f"{shard}/"))) > 10
    res = mn.finalize(client, shard)
    left = [m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")]
    # Every data blob, every old rollup and the leaked blob are gone; what remains is the
    # tombstone's own rollup, which opening the (truncated) shard needs.
    assert left == [res["kept_rollup"]] and "/rollup/" in left[0]
    s = client.machine(shard).fetch_latest()
    assert s.tombstone and not s.batches and not s.garbage and list(s.rollups) == [s.latest_rollup()[0]]  # type: ignore[index]
    assert not s.writers and not s.leased_readers
    assert mn.unreferenced_blobs(client, shard, 0) == []
    assert len(client.consensus.scan(str(shard), 0, 100)) <= 3  # rollup, link, shrink
    # Handles and reopening fail with clear usage errors.
    with pytest.raises(ShardTombstoned):
        w.heartbeat()
    with pytest.raises((LeaseExpired, ShardTombstoned)):
        r.heartbeat()
    with pytest.raises(ShardTombstoned):
        client.open(shard, KEY, VAL)
    clear_state_cache()
    fresh = PersistClient(client.raw_blob, client.raw_consensus, client.config)
    with pytest.raises(ShardTombstoned) as e:
        fresh.open_leased_reader(shard, KEY, VAL)
    assert "tombstone" in str(e.value) and "new shard id" in str(e.value)
    # Idempotent: finalizing again succeeds and deletes nothing more.
    again = mn.finalize(client, shard)
    assert again["blobs_deleted"] == 0 and again["kept_rollup"] == res["kept_rollup"]
    assert mn.gc(client, shard)["blobs_deleted"] == 0
    assert [m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")] == left


def test_finalize_resumes_after_a_crash_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    client = mem_client()
    shard, w, r = populated(client)
    w.compare_and_append([], 10, Antichain.empty())
    r.downgrade_since(Antichain.empty())
    calls = {"n": 0}
    real_delete = type(client.blob).delete

    def crashing_delete(self, key: str):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated crash in the middle of deleting")
        return real_delete(self, key)

    monkeypatch.setattr(type(client.blob), "delete", crashing_delete)
    with pytest.raises(KeyboardInterrupt):
        mn.finalize(client, shard)
    monkeypatch.undo()
    assert client.machine(shard).fetch_latest().tombstone
    res = mn.finalize(client, shard)
    assert [m.key for m in client.blob.list_keys_and_metadata(f"{shard}/")] == [res["kept_rollup"]]
    with pytest.raises(ShardTombstoned):
        client.open(shard, KEY, VAL)
