"""Boundaries of the pure state transitions (``persist_lib.transitions``), through the
public client API where there is one, on an injected clock.

A lease of ``L`` ms heartbeated at ``t0`` is alive up to and including ``t0 + L`` and
expired from ``t0 + L + 1`` on: checked for leased readers, writers and part writers,
one ms either side of the boundary.
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import LeaseExpired
from persist_lib.part_writers import PartWriter

KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])
T0 = 1_000_000
LEASE = 1_000


class Clock:
    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def mem_client(clock: Clock) -> PersistClient:
    name = uuid.uuid4().hex
    cfg = PersistConfig.for_tests(now_ms=clock, reader_lease_ms=LEASE, writer_lease_ms=LEASE)
    return PersistClient.open(f"mem://{name}", f"mem://{name}", cfg)


def test_leased_reader_is_kept_at_the_end_of_its_lease_and_expired_one_ms_later() -> None:
    clock = Clock(T0)
    client = mem_client(clock)
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 1)
    # The writer heartbeats much later, so only the reader's lease is at stake.
    clock.t = T0 + 100 * LEASE
    w.compare_and_append([], 1, 2)
    clock.t = T0 + LEASE
    assert client.expire_leases(shard) == {}
    assert r.snapshot(0).num_rows == 1, "a reader at the end of its lease still reads"
    clock.t = T0 + LEASE + 1
    assert client.expire_leases(shard) == {str(shard): {"readers": [r.reader_id], "writers": []}}
    with pytest.raises(LeaseExpired, match=r.reader_id):
        r.snapshot(0)


def test_writer_is_kept_at_the_end_of_its_lease_and_expired_one_ms_later() -> None:
    clock = Clock(T0)
    client = mem_client(clock)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    clock.t = T0 + LEASE
    assert client.expire_leases(shard) == {}
    # The append at T0 + LEASE is also a heartbeat: the lease now runs to T0 + 2 * LEASE.
    w.compare_and_append([(((1,), ("a",)), 0, 1)], 0, 1)
    clock.t = T0 + 2 * LEASE
    assert client.expire_leases(shard) == {}
    clock.t = T0 + 2 * LEASE + 1
    assert client.expire_leases(shard) == {str(shard): {"readers": [], "writers": [w.writer_id]}}
    with pytest.raises(LeaseExpired, match=w.writer_id):
        w.compare_and_append([(((2,), ("b",)), 1, 1)], 1, 2)
    assert client.inspect(shard)["upper"] == [1]


def test_part_writer_is_kept_at_the_end_of_its_lease_and_expired_one_ms_later() -> None:
    clock = Clock(T0)
    client = mem_client(clock)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY, VAL)
    clock.t = T0 + 500
    pw = PartWriter.register(client.machine(str(shard)), purpose="test", lease_ms=300)
    # The handle's writer lease ends at T0 + LEASE, the part writer's at T0 + 800.
    clock.t = T0 + 800
    assert client.expire_leases(shard) == {}
    assert pw.writer_id in client.machine(str(shard)).fetch_latest().writers
    clock.t = T0 + 801
    assert client.expire_leases(shard) == {str(shard): {"readers": [], "writers": [pw.writer_id]}}
    state = client.machine(str(shard)).fetch_latest()
    assert set(state.writers) == {w.writer_id}
    with pytest.raises(LeaseExpired, match=pw.writer_id):
        pw.heartbeat()
