"""Reads fetch and decode parts on the process's shared fetch threads
(``handles.fetch_pool``): a read starts no threads of its own (a cold read of a small
shard paid a pool start per read, issue 28), and concurrent reads sharing the threads
each get their own, correct rows."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.handles.fetch_pool import fetch_pool

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
PARALLELISM = 3


def mem_client(**cfg: Any) -> PersistClient:
    name = uuid.uuid4().hex
    base: dict[str, Any] = {"blob_target_size": 4096, "inline_threshold": 0, "fetch_parallelism": PARALLELISM}
    return PersistClient.open(f"mem://{name}", f"mem://{name}", PersistConfig.for_tests(**{**base, **cfg}))


def fetch_threads() -> dict[int, str]:
    return {
        t.ident: t.name for t in threading.enumerate()
        if t.name.startswith(f"persist-read-fetch-{PARALLELISM}") and t.ident is not None
    }


def written_shard(client: PersistClient, batches: int = 4, rows: int = 600) -> tuple[ShardId, dict[int, str]]:
    """A shard of ``batches`` multi-part batches (rows k -> "v<k>" at times 0..), and
    its contents as of the last time."""
    shard = ShardId.new()
    w, _ = client.open(shard, KEY, VAL)
    want: dict[int, str] = {}
    for i in range(batches):
        ups = [(((k,), (f"v{k}",)), i, 1) for k in range(i * rows, (i + 1) * rows)]
        w.compare_and_append(ups, i, i + 1)
        want |= {k: f"v{k}" for k in range(i * rows, (i + 1) * rows)}
    return shard, want


def test_reads_reuse_the_shared_fetch_threads() -> None:
    client = mem_client()
    shard, want = written_shard(client)
    r = client.open_leased_reader(shard, KEY, VAL)
    state = client.machine(shard).fetch_latest()
    assert sum(len(b.parts) for _, b in state.trace_batches()) > PARALLELISM, "a read fetches in parallel"
    first = r.snapshot(3)
    after_first = fetch_threads()
    # The read ran on the shared pool, whose threads outlive it (a per-read pool would
    # have been joined at the end of the read: none of its threads would be left).
    assert 0 < len(after_first) <= PARALLELISM, after_first
    for as_of in (3, 2, 1, 3):
        r.snapshot(as_of)
        one_shot = client.snapshot(shard, KEY, VAL, as_of)
        assert one_shot.num_rows == (as_of + 1) * 600
    # No read started a thread: the same threads, no more than the pool's size.
    assert len(fetch_threads()) <= PARALLELISM
    assert set(after_first) <= set(fetch_threads()), "the fetch threads were replaced"
    assert {row["k"]: row["v"] for row in first.to_pylist()} == want
    r.expire()
    client.close()


def test_concurrent_reads_share_the_threads_and_get_their_own_rows() -> None:
    """Eight reads at once from eight threads, on two shards and at several as-ofs, all
    through a pool of three fetch threads: each returns exactly its own snapshot."""
    client = mem_client()
    shards = [written_shard(client, batches=4, rows=300 + 100 * j) for j in range(2)]

    def read(i: int) -> tuple[int, int, dict[int, str]]:
        j, as_of = i % 2, i % 4
        shard, _ = shards[j]
        t = client.snapshot(shard, KEY, VAL, as_of)
        return j, as_of, {row["k"]: row["v"] for row in t.to_pylist()}

    with ThreadPoolExecutor(max_workers=8) as ex:
        results = list(ex.map(read, range(16)))
    for j, as_of, got in results:
        rows = 300 + 100 * j
        assert got == {k: f"v{k}" for k in range((as_of + 1) * rows)}, (j, as_of)
    assert len(fetch_threads()) <= PARALLELISM
    assert fetch_pool(PARALLELISM) is fetch_pool(PARALLELISM)
    client.close()
