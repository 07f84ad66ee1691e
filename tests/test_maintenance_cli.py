"""The maintenance subcommands of ``persist``: compact, gc, expire-leases, leaked-blobs,
finalize (and the spine/debt fields of ``inspect``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa

from persist_lib import Antichain, PersistClient, PersistConfig, ShardId

PERSIST = [sys.executable, "-m", "persist_lib.cli.main"]
KEY = pa.schema([("k", pa.int64())])
VAL = pa.schema([("v", pa.string())])


def run(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PERSIST_HOME": str(home)}
    env.pop("PERSIST_BLOB_URI", None)
    env.pop("PERSIST_CONSENSUS_URI", None)
    return subprocess.run(PERSIST + args, env=env, capture_output=True, text=True, timeout=120)


def ok(args: list[str], home: Path) -> object:
    out = run([*args, "--json"], home)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_maintenance_commands(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client = PersistClient.default(
        home, PersistConfig.for_tests(blob_target_size=4096, inline_threshold=0, writer_lease_ms=10**12)
    )
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(6):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(100)], t, t + 1)
    leaked = f"{shard}/w{uuid.uuid4()}/pleaked"
    client.blob.set(leaked, b"crashed writer")

    doc = ok(["inspect", str(shard)], home)
    assert isinstance(doc, dict) and doc["compaction_debt"] > 0 and len(doc["spine"]) == 6
    assert {"level", "len", "pending_request"} <= set(doc["spine"][0])

    res = ok(["compact", str(shard)], home)
    assert isinstance(res, dict) and res["merges_applied"] >= 1 and res["compaction_debt_after"] == 0
    assert res["batches_after"] < res["batches_before"]
    assert ok(["inspect", str(shard)], home)["compaction_debt"] == 0  # type: ignore[index]

    # The reader holds its seqno (it registered before the merges): GC must wait.
    res = ok(["gc", str(shard)], home)
    assert isinstance(res, dict) and res["blobs_deleted"] == 0 and res["garbage_pending"] > 0

    # Its lease lapses (the lease is judged by the clock of whoever expires it).
    out = run(["expire-leases", str(shard), "--json"], home)
    assert out.returncode == 0 and json.loads(out.stdout) == {}  # not lapsed yet (15 min)
    later = client.config.now_ms() + 16 * 60 * 1000
    assert client.expire_leases(shard, now=later)[str(shard)] == {"readers": [r.reader_id], "writers": []}
    res = ok(["gc", str(shard)], home)
    assert isinstance(res, dict) and res["blobs_deleted"] > 0 and res["garbage_pending"] == 0

    res = ok(["leaked-blobs", str(shard)], home)
    assert res == {str(shard): {"blobs": 0, "bytes": 0, "deleted": 0, "keys": []}}  # grace period
    res = ok(["leaked-blobs", "--older-than-s", "0"], home)
    assert isinstance(res, dict) and res[str(shard)]["keys"] == [leaked]
    res = ok(["leaked-blobs", str(shard), "--older-than-s", "0", "--delete"], home)
    assert isinstance(res, dict) and res[str(shard)]["deleted"] == 1
    assert client.blob.get(leaked) is None

    out = run(["finalize", str(shard)], home)
    assert out.returncode == 2 and "can't be finalized yet" in out.stderr and "Antichain.empty()" in out.stderr
    w.compare_and_append([], 6, Antichain.empty())
    r2 = client.open_leased_reader(shard, KEY, VAL)
    r2.downgrade_since(Antichain.empty())
    res = ok(["finalize", str(shard)], home)
    assert isinstance(res, dict) and res["tombstone"] is True
    out = run(["--json", "inspect", str(shard)], home)
    assert out.returncode == 0 and json.loads(out.stdout)["tombstone"] is True
    client.close()


def test_quarantined_merge_in_inspect_and_retry_from_the_cli(tmp_path: Path) -> None:
    home = tmp_path / "home"
    client = PersistClient.default(home, PersistConfig.for_tests(blob_target_size=4096, inline_threshold=0))
    shard = ShardId.new()
    w, r = client.open(shard, KEY, VAL)
    for t in range(2):
        w.compare_and_append([(((i,), (f"v{t}",)), t, 1) for i in range(100)], t, t + 1)
    part = next(iter(client.machine(shard).fetch_latest().batches.values())).parts[0]
    assert part.key is not None
    good = client.blob.get(part.key)
    assert good is not None
    client.raw_blob.set(part.key, good[:10])  # truncated: corrupt
    out = run(["compact", str(shard)], home)
    assert out.returncode != 0 and "CorruptionError" in out.stderr + out.stdout
    doc = ok(["inspect", str(shard)], home)
    assert isinstance(doc, dict) and len(doc["quarantined_merges"]) == 1
    assert "checksum" in doc["quarantined_merges"][0]["error"] or "truncated" in doc["quarantined_merges"][0]["error"]
    assert ok(["compact", str(shard)], home)["merges_applied"] == 0  # type: ignore[index]
    client.raw_blob.set(part.key, good)  # restored from a backup
    res = ok(["compact", str(shard), "--retry-quarantined"], home)
    assert isinstance(res, dict) and res["merges_applied"] >= 1 and res["quarantined_merges"] == []
    client.close()
