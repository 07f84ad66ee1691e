"""BatchBuilder: multi-part batches, bounded uploads, inline parts, and cleanup."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest

from persist_lib.errors import Determinate, InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.location.base import Blob
from persist_lib.location.mem import MemBlob
from persist_lib.shard.batch_builder import BatchBuilder, build_batch, delete_batch_blobs
from persist_lib.shard.batch_meta import HollowBatch
from persist_lib.shard.codec import Schemas, internal_schema, normalize_updates
from persist_lib.shard.consolidate import consolidate, is_consolidated, merge_sorted
from persist_lib.shard.parts import fetch_part

S = Schemas.create(
    pa.schema([("id", pa.int64()), ("name", pa.string())]), pa.schema([("amount", pa.float64())])
)
TARGET = 64 << 10


def fresh_blob() -> MemBlob:
    return MemBlob(f"bb-{uuid.uuid4().hex}")


def keys(blob: Blob) -> list[str]:
    return [m.key for m in blob.list_keys_and_metadata("")]


def updates(n: int, *, seed: int = 0, tmax: int = 10, distinct: int = 5000) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, distinct, n)
    return normalize_updates(
        pa.table(
            {
                "id": ids,
                "name": pa.array(np.char.add("name-", (ids % 97).astype(str))),
                "amount": (ids % 13).astype(np.float64),
                "ts": rng.integers(0, tmax, n),
                "diff": rng.choice(np.array([-1, 1, 2]), n),
            }
        ),
        S,
        shard="s1",
    )


def read_batch(blob: Blob, batch: HollowBatch) -> pa.Table:
    parts = [fetch_part(blob, p, S, "s1") for p in batch.parts]
    for p in parts:
        assert is_consolidated(p)
    return merge_sorted(parts) if parts else internal_schema(S).empty_table()


class SlowBlob(MemBlob):
    """Counts concurrent ``set`` calls (and can fail the n-th one)."""

    def __init__(self, delay: float = 0.02, fail_on: int | None = None) -> None:
        super().__init__(f"slow-{uuid.uuid4().hex}")
        self.delay = delay
        self.fail_on = fail_on
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.sets = 0

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.active += 1
            self.sets += 1
            n = self.sets
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay)
            if self.fail_on is not None and n == self.fail_on:
                raise Determinate(f"injected failure of set #{n} ({key})")
            super().set(key, value)
        finally:
            with self.lock:
                self.active -= 1


def test_multi_part_batch_equals_consolidated_input() -> None:
    blob = fresh_blob()
    data = updates(60_000)
    b = BatchBuilder(
        blob, S, shard="s1", writer="w1", lower=Antichain([0]), target_part_bytes=TARGET
    )
    for chunk in data.to_batches(max_chunksize=7_000):  # chunk sizes unrelated to parts
        b.add(pa.Table.from_batches([chunk]))
    batch = b.finish(Antichain([10]))
    assert batch.lower == Antichain([0]) and batch.upper == Antichain([10])
    assert batch.since == Antichain([0])
    assert len(batch.parts) > 10
    # Only the remainder flushed by finish may be small enough to be inline.
    assert all(p.key is not None and p.key.startswith("s1/w1/p") for p in batch.parts[:-1])
    assert sorted(keys(blob)) == sorted(batch.blob_keys())
    assert batch.len == sum(p.count for p in batch.parts)
    assert read_batch(blob, batch).equals(consolidate(data))
    for p in batch.parts:
        assert 0 <= p.tmin <= p.tmax < 10


def test_large_chunk_is_split_across_upload_threads() -> None:
    """A chunk of >= 16 MiB is cut into max_inflight_uploads parts (sorted and encoded in
    parallel) even below the part target; each part is a sorted, consolidated run."""
    from persist_lib.shard.batch_builder import MIN_PARALLEL_PART_BYTES

    blob = SlowBlob(delay=0.3)
    data = updates(700_000, distinct=1_000_000)
    assert data.nbytes >= 2 * MIN_PARALLEL_PART_BYTES
    for inflight, want in ((1, 1), (2, 2), (3, 3)):
        batch = build_batch(
            blob, S, data, shard="s1", writer=f"w{inflight}", lower=0, upper=10,
            target_part_bytes=128 << 20, max_inflight_uploads=inflight,
        )
        assert len(batch.parts) == want, batch.parts
        assert read_batch(blob, batch).equals(consolidate(data))  # each part a sorted run
    assert blob.max_active >= 2  # parts were written concurrently


def test_one_huge_chunk_is_split_into_target_sized_parts() -> None:
    blob = fresh_blob()
    data = updates(50_000)
    batch = build_batch(
        blob, S, data, shard="s1", writer="w1", lower=0, upper=10, target_part_bytes=TARGET
    )
    expected_parts = data.nbytes // TARGET
    assert expected_parts - 1 <= len(batch.parts) <= expected_parts + 1
    assert read_batch(blob, batch).equals(consolidate(data))


def test_at_most_two_uploads_in_flight() -> None:
    blob = SlowBlob(delay=0.03)
    # Even with a big shared executor, the builder keeps its own limit.
    with ThreadPoolExecutor(max_workers=8) as pool:
        b = BatchBuilder(
            blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET, executor=pool
        )
        for chunk in updates(40_000).to_batches(max_chunksize=2_000):
            b.add(pa.Table.from_batches([chunk]))
        batch = b.finish(10)
    assert blob.sets == len(batch.blob_keys()) >= 8
    assert blob.max_active == 2


def test_max_inflight_one() -> None:
    blob = SlowBlob(delay=0.01)
    batch = build_batch(
        blob, S, updates(20_000), shard="s1", writer="w1", lower=0, upper=10,
        target_part_bytes=TARGET, max_inflight_uploads=1,
    )  # fmt: skip
    assert len(batch.parts) > 2 and blob.max_active == 1


def test_small_batch_is_inline() -> None:
    blob = fresh_blob()
    data = normalize_updates([(((i, "a"), (1.0,)), 5, 1) for i in range(3)], S, shard="s1")
    batch = build_batch(blob, S, data, shard="s1", writer="w1", lower=5, upper=6)
    assert len(batch.parts) == 1
    (p,) = batch.parts
    assert p.key is None and p.inline is not None and p.size == len(p.inline) <= 4096
    assert keys(blob) == []
    assert read_batch(blob, batch).equals(consolidate(data))
    # The batch survives its JSON form (as state stores it).
    assert HollowBatch.from_json(batch.to_json()) == batch
    # inline_threshold=0 forces a blob upload.
    batch2 = build_batch(
        blob, S, data, shard="s1", writer="w1", lower=5, upper=6, inline_threshold=0
    )
    assert batch2.parts[0].key is not None and keys(blob) == batch2.blob_keys()


def test_user_layout_and_tuples_are_accepted() -> None:
    blob = fresh_blob()
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0)
    b.add([(((1, "a"), (1.0,)), 0, 1)])
    b.add(pa.table({"id": [1], "name": ["a"], "amount": [1.0], "ts": [0], "diff": [2]}))
    batch = b.finish(1)
    assert read_batch(blob, batch).column("d").to_pylist() == [3]
    assert b.num_updates_added == 2


def test_empty_and_cancelled_batches_have_no_parts() -> None:
    blob = fresh_blob()
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=3)
    batch = b.finish(7, since=2)
    assert batch == HollowBatch(Antichain([3]), Antichain([7]), Antichain([2]), ())
    cancel = normalize_updates(
        [(((1, "a"), (1.0,)), 0, 1), (((1, "a"), (1.0,)), 0, -1)], S, shard="s1"
    )
    batch = build_batch(blob, S, cancel, shard="s1", writer="w1", lower=0, upper=1)
    assert batch.parts == () and keys(blob) == []
    # A closed upper is fine.
    batch = build_batch(blob, S, updates(10), shard="s1", writer="w1", lower=0, upper=Antichain())
    assert batch.upper.is_empty() and 0 < batch.len <= 10


@pytest.mark.parametrize(
    "lower, upper, match",
    [
        (3, 10, r"update time [0-2] is outside the batch bounds \[lower \[3\], upper \[10\]\)"),
        (0, 5, r"update time [5-9] is outside the batch bounds \[lower \[0\], upper \[5\]\)"),
        (
            0,
            Antichain([0]),
            r"update time 9 is outside the batch bounds \[lower \[0\], upper \[0\]\)",
        ),
        (4, 2, r"batch upper \[2\] is less than its lower \[4\]"),
    ],
)
def test_out_of_range_times_raise_and_leave_nothing(lower: int, upper: object, match: str) -> None:
    blob = fresh_blob()
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=lower, target_part_bytes=TARGET)
    b.add(updates(30_000, tmax=10))
    assert len(keys(blob)) > 0  # parts were uploaded before the bad times were noticed
    with pytest.raises(InvalidUsage, match="^shard s1: " + match):
        b.finish(upper)  # type: ignore[arg-type]
    assert keys(blob) == []
    with pytest.raises(InvalidUsage, match="is aborted"):
        b.add(updates(1))


def test_abort_deletes_parts_also_after_finish() -> None:
    blob = fresh_blob()
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET)
    b.add(updates(20_000))
    assert keys(blob)
    b.abort()
    assert keys(blob) == []
    # After finish (the compare-and-append lost): abort and delete_batch_blobs both clean up.
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET)
    b.add(updates(20_000))
    batch = b.finish(10)
    assert sorted(keys(blob)) == sorted(batch.blob_keys())
    assert b.abort() >= len(batch.blob_keys())
    assert keys(blob) == []
    batch = build_batch(
        blob,
        S,
        updates(20_000),
        shard="s1",
        writer="w1",
        lower=0,
        upper=10,
        target_part_bytes=TARGET,
    )
    assert delete_batch_blobs(blob, batch) == len(batch.blob_keys()) > 0
    assert keys(blob) == []


def test_context_manager_aborts_unfinished_builders() -> None:
    blob = fresh_blob()
    with pytest.raises(RuntimeError):
        with BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET) as b:
            b.add(updates(20_000))
            raise RuntimeError("caller failed")
    assert keys(blob) == []
    with BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET) as b:
        b.add(updates(20_000))
        batch = b.finish(10)
    assert sorted(keys(blob)) == sorted(batch.blob_keys())


def test_upload_failure_aborts_and_raises() -> None:
    blob = SlowBlob(delay=0.005, fail_on=3)
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET)
    with pytest.raises(Determinate, match="injected failure of set #3"):
        for chunk in updates(60_000).to_batches(max_chunksize=3_000):
            b.add(pa.Table.from_batches([chunk]))
        b.finish(10)
    assert keys(blob) == []
    with pytest.raises(InvalidUsage, match="aborted"):
        b.finish(10)


def test_upload_failure_surfaces_in_finish() -> None:
    blob = SlowBlob(delay=0.0, fail_on=1)
    with pytest.raises(Determinate):
        build_batch(
            blob,
            S,
            updates(5_000),
            shard="s1",
            writer="w1",
            lower=0,
            upper=10,
            target_part_bytes=1 << 30,
            inline_threshold=0,
        )
    assert keys(blob) == []


def test_invalid_chunk_is_rejected_without_aborting() -> None:
    blob = fresh_blob()
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0)
    with pytest.raises(InvalidUsage, match="missing column"):
        b.add(pa.table({"id": [1]}))
    b.add(updates(5))
    assert b.finish(10).len > 0


def test_bad_arguments() -> None:
    with pytest.raises(InvalidUsage, match="target_part_bytes"):
        BatchBuilder(fresh_blob(), S, shard="s1", writer="w1", lower=0, target_part_bytes=0)
    with pytest.raises(InvalidUsage, match="max_inflight_uploads"):
        BatchBuilder(fresh_blob(), S, shard="s1", writer="w1", lower=0, max_inflight_uploads=0)
    for bad in (-1, 1.5, "4MiB", True):
        with pytest.raises(InvalidUsage, match="key_range_min_bytes"):
            BatchBuilder(fresh_blob(), S, shard="s1", writer="w1", lower=0, key_range_min_bytes=bad)  # type: ignore[arg-type]


# ----- key-range parts (issue 28) ----------------------------------------------------------


def test_key_range_parts_equal_the_consolidated_input_and_are_disjoint() -> None:
    """A chunk past ``key_range_min_bytes`` becomes sorted parts of disjoint ``id``
    ranges, at most two uploads in flight, whose rows are ``consolidate`` of the input;
    a small chunk buffered before it is flushed as a part of its own first."""
    blob = SlowBlob(delay=0.01)
    small, big = updates(300, seed=1), updates(40_000, seed=2)
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET,
                     key_range_min_bytes=TARGET)
    b.add(small)
    assert small.nbytes < TARGET <= big.nbytes
    b.add(big)
    batch = b.finish(10)
    assert blob.max_active <= 2
    first, *ranges = batch.parts
    assert first.count == consolidate(small).num_rows
    assert len(ranges) >= 10 and all(p.sorted for p in ranges)
    bounds = [next((lo, hi) for c, lo, hi, _ in p.stats or () if c == "k.id") for p in ranges]
    assert all(a[1] < b_[0] for a, b_ in zip(bounds, bounds[1:], strict=False))  # in key order
    got = pa.concat_tables([fetch_part(blob, p, S, "s1") for p in ranges])
    assert got.equals(consolidate(big))
    assert sorted(keys(blob)) == sorted(batch.blob_keys())


def test_a_failed_key_range_upload_deletes_every_part() -> None:
    blob = SlowBlob(delay=0.002, fail_on=4)
    b = BatchBuilder(blob, S, shard="s1", writer="w1", lower=0, target_part_bytes=TARGET,
                     key_range_min_bytes=0)
    with pytest.raises(Determinate, match="injected failure of set #4"):
        b.add(updates(40_000))
        b.finish(10)
    assert keys(blob) == []


def test_a_leading_key_without_a_flat_order_is_cut_in_row_order() -> None:
    """Struct keys can't be cut into key ranges: the chunk is cut in row order as before
    (here unsorted parts past ``unsorted_min_bytes``), and nothing is lost."""
    schemas = Schemas.create(pa.schema([("k", pa.struct([("a", pa.int64())]))]), pa.schema([("v", pa.int64())]))
    n = 30_000
    rng = np.random.default_rng(3)
    t = normalize_updates(
        pa.table({
            "k": pa.array([{"a": int(x)} for x in rng.integers(0, 1000, n)]),
            "v": pa.array(rng.integers(0, 5, n)),
            "ts": pa.array(np.zeros(n, dtype=np.int64)),
            "diff": pa.array(np.ones(n, dtype=np.int64)),
        }),
        schemas,
        shard="s1",
    )
    blob = fresh_blob()
    batch = build_batch(blob, schemas, t, shard="s1", writer="w1", lower=0, upper=1,
                        target_part_bytes=TARGET, key_range_min_bytes=0, unsorted_min_bytes=1)
    assert len(batch.parts) > 1 and not any(p.sorted for p in batch.parts)
    got = consolidate(pa.concat_tables([fetch_part(blob, p, schemas, "s1") for p in batch.parts]))
    assert got.equals(consolidate(t))
