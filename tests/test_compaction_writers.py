"""One registered part writer for a background compactor's merges of a shard
(``persist_lib.shard.compaction_writers``): the merges of a burst take no registration
write each, the registration is heartbeated and released at close, any outcome but
"applied" retires it, and a crashed compactor's in-flight output becomes sweepable once
its lease is gone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import LeaseExpired
from persist_lib.handles.maintenance import _schemas
from persist_lib.handles.merge_deferral import DeferralPolicy
from persist_lib.shard import gc as gcmod
from persist_lib.shard import maintenance_transitions as mt
from persist_lib.shard import transitions as tr
from persist_lib.shard.compaction_writers import CompactionWriters
from persist_lib.shard.compactor import compact_request
from persist_lib.shard.parts import part_blob_key
from persist_lib.shard.runs import COMPACTOR_WRITER_PREFIX
from persist_lib.shard.spine import compaction_requests

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
ROWS = 10


def file_client(d: Path, *, background: bool = True) -> PersistClient:
    """File blob + SQLite consensus; parts never inline, so every merge uploads."""
    (d / "blob").mkdir(exist_ok=True)
    return PersistClient.open(
        f"file://{d / 'blob'}",
        f"sqlite:///{d / 'consensus.db'}",
        PersistConfig.for_tests(
            compaction_enabled=background, compaction_workers=1, inline_threshold=0
        ),
    )


def updates(t: int) -> list:
    return [(((t * ROWS + i,), (f"v{t}",)), t, 1) for i in range(ROWS)]


def compactor_writers(client: PersistClient, shard: ShardId) -> list[str]:
    s = client.machine(shard).fetch_latest()
    return [w for w in s.writers if w.startswith(COMPACTOR_WRITER_PREFIX)]


def test_a_burst_of_merges_registers_one_part_writer_released_at_close(tmp_path: Path) -> None:
    """Every background merge of the burst rewrites data into blob parts; they all upload
    under one registration (one ``register_part_writer`` write, not one per merge), the
    apply keeps it, and closing the client releases it. Every update is read once."""
    client = file_client(tmp_path)
    bg = client.background_compactor()
    bg.deferral = DeferralPolicy(max_fanin=2)  # off: a merge at nearly every other commit
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    n = 16
    for t in range(n):
        w.compare_and_append(updates(t), t, t + 1)
        assert bg.wait_idle(60)
    m = client.machine(shard)
    merges = m.metrics.committed_by.get("apply_merge_res", 0)
    assert merges >= 8, m.metrics.committed_by
    assert m.metrics.committed_by.get("register_part_writer", 0) == 1, m.metrics.committed_by
    assert bg.writers.registered == 1 and bg.writers.retired == 0
    assert len(compactor_writers(client, shard)) == 1  # still registered: shared
    assert compaction_requests(m.fetch_latest()) == []
    got = Counter((row["k"], row["v"], row["diff"]) for row in r.snapshot(n - 1).to_pylist())
    assert got == Counter((t * ROWS + i, f"v{t}", 1) for t in range(n) for i in range(ROWS))
    w.expire()
    r.expire()
    client.close()
    client = file_client(tmp_path, background=False)
    assert compactor_writers(client, shard) == []  # released at close
    client.close()


def test_a_merge_not_applied_retires_the_shared_writer_and_deletes_its_output(tmp_path: Path) -> None:
    """A merge whose inputs were replaced meanwhile is not applied: its output is deleted
    and the shared writer released at once (not kept until close), and the next merge
    registers a fresh one."""
    client = file_client(tmp_path, background=False)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    for t in range(4):
        w.compare_and_append(updates(t), t, t + 1)
    m = client.machine(shard)
    s = m.fetch_latest()
    reqs = compaction_requests(s)
    assert reqs
    req = reqs[0]
    writers = CompactionWriters(client)
    first = compact_request(m, _schemas(s), client.config, req, context=client, writers=writers)
    assert first.applied
    shared = compactor_writers(client, shard)
    assert len(shared) == 1
    # The same request again: its inputs are gone, so it is not applied.
    again = compact_request(m, _schemas(s), client.config, req, context=client, writers=writers)
    assert not again.applied
    assert again.outcome is mt.MergeOutcome.NOT_APPLIED_NO_MATCH
    assert writers.retired == 1
    assert compactor_writers(client, shard) == []
    listed = {k.key for k in m.blob.list_keys_and_metadata(f"{shard}/{shared[0]}/")}
    live = set()
    for _, b in m.fetch_latest().trace_batches():
        live.update(b.blob_keys())
    assert listed <= live  # the unapplied output was deleted
    writers.close()
    client.close()


def test_a_crashed_compactors_output_is_kept_while_registered_and_swept_after_expiry(
    tmp_path: Path,
) -> None:
    """The crash story: a part uploaded under the shared writer and never linked (the
    process died between upload and apply) is kept by the leaked-blob sweeper while the
    registration holds, and swept once the lease is expired (no heartbeats any more)."""
    client = file_client(tmp_path, background=False)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    w.compare_and_append(updates(0), 0, 1)
    m = client.machine(shard)
    writers = CompactionWriters()  # no context: nothing heartbeats it, as after a crash
    pw = writers.acquire(m, layered=False)
    assert writers.acquire(m, layered=False) is pw  # shared by the next merge
    key = part_blob_key(m.shard_id, pw.writer_id)
    m.blob.set(key, b"output of a merge that never applied")

    def swept() -> set[str]:
        found = gcmod.unreferenced_blobs(
            m.blob, m.consensus, m.shard_id, now_ms=10**15, older_than_ms=0
        )
        return {str(o["key"]) for o in found}

    assert key not in swept()
    m.apply("expire_writer", lambda s, now: tr.expire_writer(s, now, writer_id=pw.writer_id))
    assert key in swept()
    client.close()


def test_a_shared_writer_found_expired_by_its_heartbeat_is_replaced(tmp_path: Path) -> None:
    """If someone expired the shared registration (a lease sweep while heartbeats lagged),
    its next heartbeat ends it (``LeaseExpired``, as for a handle) and the next merge
    registers a fresh writer instead of merging under the dead one."""
    client = file_client(tmp_path, background=False)
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    w.compare_and_append(updates(0), 0, 1)
    m = client.machine(shard)
    writers = CompactionWriters(client)
    pw = writers.acquire(m, layered=False)
    m.apply("expire_writer", lambda s, now: tr.expire_writer(s, now, writer_id=pw.writer_id))
    with pytest.raises(LeaseExpired):
        pw.heartbeat()
    fresh = writers.acquire(m, layered=False)
    assert fresh is not pw and fresh.writer_id in m.fetch_latest().writers
    writers.close()
    assert fresh.writer_id not in m.fetch_latest().writers
    client.close()
