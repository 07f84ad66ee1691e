"""A short end-to-end demo of persist_lib on the embedded default (no servers needed).

It creates a shard, appends a few batches with ``compare_and_append``, shows what a
lost race looks like, reads snapshots at several times, follows the shard with
``listen`` from a second reader, advances ``since``, and prints the shard's state.
"""

from __future__ import annotations

import os
import sys
import time

import pyarrow as pa

from persist_lib import PersistClient, ShardId
from persist_lib.errors import UpperMismatch
from persist_lib.handles.listen import ListenUpdates


def main() -> int:
    home = os.environ.get("PERSIST_HOME", ".persist")
    client = PersistClient.default(home)
    print(f"persist demo: embedded location under {os.path.abspath(home)}")
    key = pa.schema([("user", pa.string())])
    val = pa.schema([("balance", pa.int64())])
    shard = ShardId.new()
    write, read = client.open(shard, key, val, purpose="demo")
    print(f"opened shard {shard}: upper={write.upper} since={read.since}")

    t0 = time.perf_counter()
    updates = [
        ((("alice",), (100,)), 0, 1),
        ((("bob",), (50,)), 0, 1),
    ]
    write.compare_and_append(updates, 0, 1)
    # bob pays alice 20 at time 1: retract the old balances, assert the new ones
    write.compare_and_append(
        [
            ((("alice",), (100,)), 1, -1),
            ((("alice",), (120,)), 1, 1),
            ((("bob",), (50,)), 1, -1),
            ((("bob",), (30,)), 1, 1),
        ],
        1,
        2,
    )
    print(f"appended 2 batches in {1000 * (time.perf_counter() - t0):.1f} ms; upper={write.upper}")
    try:
        write.compare_and_append([((("carol",), (5,)), 0, 1)], 0, 1)
    except UpperMismatch as e:
        print(f"a stale writer loses its race, nothing written: UpperMismatch(current={e.current})")

    for as_of in (0, 1):
        snap = read.snapshot(as_of).sort_by("user").to_pylist()
        print(f"snapshot as of {as_of}: {snap}")

    _, follower = client.open(shard, key, val, purpose="demo-listener")
    listen = follower.listen(as_of=1)
    write.compare_and_append([((("carol",), (5,)), 2, 1)], 2, 3)
    for event in listen.next(timeout_s=5.0):
        if isinstance(event, ListenUpdates):
            print(f"listen saw updates in [{event.lower}, {event.upper}): {event.table.to_pylist()}")
        else:
            print(f"listen progress: upper={event.upper}")

    read.downgrade_since(2)
    follower.downgrade_since(2)
    state = client.inspect(shard)
    print(
        f"state: seqno={state['seqno']} since={state['since']} upper={state['upper']} "
        f"batches={state['num_batches']} updates={state['num_updates']} bytes={state['bytes']} "
        f"readers={len(state['leased_readers'])} writers={len(state['writers'])}"
    )
    print(f"inspect it yourself: .venv/bin/persist inspect {shard}")
    write.expire()
    read.expire()
    follower.expire()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
