"""A controller killed with ``kill -9`` mid-command leaves a consistent catalog after restart.

A subprocess loops over create / write / create_rendition / handover / delete on the
embedded location (file blob + SQLite) and is killed at a random moment; a new
controller recovers. Afterwards: no half-made collection is visible, every listed
collection is fully readable, and every shard that isn't part of a listed collection
(or the catalog) has been finalized (a tombstone), so its blobs are gone.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from persist_lib import PersistClient, PersistConfig
from persist_lib.storage import StorageController
from persist_lib.storage.catalog import default_catalog_shard
from persist_lib.txn.log import default_txn_log_shard
from tests.support.durable_ops import with_durable_op_counter

WORKLOAD = with_durable_op_counter(textwrap.dedent(
    """
    import sys, pyarrow as pa
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.storage import StorageController
    blob, cons, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # Every durable operation prints "op N" once it returned: the parent kills right
    # after a chosen one, inside whichever command is running then.
    import threading
    # @COUNT_DURABLE_OPS
    client = PersistClient.open(blob, cons, PersistConfig.for_tests())
    ctl = StorageController(client)
    K = pa.schema([("k", pa.int64())]); V = pa.schema([("v", pa.string())])
    i = 0
    while True:
        name = f"c{seed}_{i}"
        ctl.create_collection(name, K, V, num_shards=2)
        w = ctl.open_writer(name)
        w.append([(((j,), ("x",)), 0, 1) for j in range(10)], 0, 2)
        ctl.create_rendition(name, "r1", 3)
        w1 = ctl.open_writer(name, "r1")
        w1.append([(((j,), ("y",)), 0, 1) for j in range(10)], 0, 3)
        ctl.handover(name, to="r1", at=2)
        if i % 2 == 0:
            ctl.delete_collection(name)
        print("cycle", i, flush=True)
        i += 1
    """
))


def _check_consistent(blob: str, cons: str) -> dict[str, int]:
    client = PersistClient.open(blob, cons, PersistConfig.for_tests())
    ctl = StorageController(client)  # recovers
    cat, _ = ctl.catalog.load()
    assert all(s["status"] == "ready" for s in cat.values()), cat
    # The catalog and the txn log (its multi-shard collections are transactional by
    # default) are the location's own shards.
    live_shards = {str(default_catalog_shard()), str(default_txn_log_shard())}
    checked = 0
    for name in ctl.list_collections():
        d = ctl.describe(name)
        live_shards.add(d["metadata_shard"])
        for r, info in d["renditions"].items():
            assert info["status"] in ("ready", "active", "retired", "dropped"), (name, r, info)
            if info["status"] in ("ready", "active", "retired"):
                live_shards.update(info["shards"])
        reader = ctl.acquire_read_handle(name)
        # readable where both the metadata and the active rendition are complete
        upper = min(d["metadata_upper"][0], d["renditions"][d["active_rendition"]]["upper"][0])
        for t in range(upper):
            # Rendition r0 holds (j, "x") and is active before the handover at 2; r1
            # holds (j, "y") and is active from 2 on: readable, and right, at every
            # decided time.
            got: Counter = Counter()
            for row in reader.snapshot(t).to_pylist():
                got[(row["k"], row["v"])] += row["diff"]
            v = "x" if t < 2 else "y"
            assert +got == Counter({(j, v): 1 for j in range(10)}), (name, t, got)
            checked += 1
        reader.expire()
    leftovers = 0
    for shard in client.list_shards():
        if shard in live_shards:
            continue
        s = client.machine(shard).fetch_latest()
        assert s.tombstone, f"shard {shard} belongs to no collection and was not finalized"
        blobs = [m.key for m in client.blob.list_keys_and_metadata(shard + "/") if "/rollup/" not in m.key]
        assert blobs == [], blobs
        leftovers += 1
    return {"collections": len(ctl.list_collections()), "finalized_shards": leftovers, "snapshots": checked}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_controller_mid_command(tmp_path: Path, seed: int) -> None:
    (tmp_path / "blob").mkdir()
    blob, cons = f"file://{tmp_path / 'blob'}", f"sqlite:///{tmp_path / 'c.db'}"
    rng = random.Random(seed)
    total_cycles = 0
    for round_ in range(2):
        # (a cycle's multi-shard writes are transactions: about 4/3 of the operations of
        # the direct writes this range was first drawn for)
        kill_after = rng.randint(60, 400) * 4 // 3
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKLOAD, blob, cons, str(seed * 10 + round_)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert proc.stdout is not None
        seen, cycles = 0, 0
        while seen < kill_after:
            line = proc.stdout.readline()
            if not line:
                break  # it exited: the assertion below reports why
            if line.startswith("op "):
                seen = int(line.split()[1])
            elif line.startswith("cycle"):
                cycles += 1
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        assert "Traceback" not in err, err
        assert seen == kill_after, f"the workload stopped after {seen} operations: {err}"
        total_cycles += cycles + out.count("cycle")
        figures = _check_consistent(blob, cons)
        print(f"seed {seed} round {round_}: killed after op {kill_after}, {cycles} cycles; {figures}")
    # The commands ran before the kills: some collections were made and read back.
    assert total_cycles >= 1
    assert figures["snapshots"] >= 1, figures
