"""Commit latency and throughput of transactions touching 1, 4 and 16 shards, against a
plain single-shard ``compare_and_append`` (issue 27).

Run: ``.venv/bin/python -m bench.txn_commit [--commits N] [--rows R]``. Embedded, durable
location (file blob with fsync + SQLite ``synchronous=FULL``) in a temp dir; background
compaction on, as in use (it keeps the txn log small by folding tidied entries away). Each commit writes ``R`` rows to every shard it
touches; a transaction's time covers its whole path (part-writer registrations, parts,
the log CAS, the applies, the tidy). One run, ratios against the single-shard baseline;
it prints a table and a JSON line. Standalone: not part of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import KEY_SCHEMA, VAL_SCHEMA, persist_file_client, update_batch


def _summary(lat: list[float], shards: int) -> dict[str, Any]:
    total = sum(lat)
    return {
        "shards": shards,
        "commits": len(lat),
        "p50_ms": round(statistics.median(lat) * 1000, 2),
        "mean_ms": round(total / len(lat) * 1000, 2),
        "max_ms": round(max(lat) * 1000, 2),
        "commits_per_s": round(len(lat) / total, 1),
    }


def _plain(d: Path, shards: int, commits: int, rows: int) -> dict[str, Any]:
    """``compare_and_append`` on each of ``shards`` shards in turn (atomic for one only)."""
    from persist_lib.ids import ShardId

    client = persist_file_client(d, compaction_enabled=True)
    writers = [client.open(ShardId.new(), KEY_SCHEMA, VAL_SCHEMA)[0] for _ in range(shards)]
    lat = []
    for i in range(commits):
        bs = [update_batch(rows, i, (i * shards + j) * rows) for j in range(shards)]
        t0 = time.perf_counter()
        for w, b in zip(writers, bs, strict=True):
            w.compare_and_append(b, i, i + 1)
        lat.append(time.perf_counter() - t0)
    client.close()
    return _summary(lat, shards)


def _txn(d: Path, shards: int, commits: int, rows: int) -> dict[str, Any]:
    from persist_lib.frontier import Antichain
    from persist_lib.ids import ShardId
    from persist_lib.shard.codec import Schemas, normalize_checked
    from persist_lib.txn.txns import ShardWrite, Txns

    client = persist_file_client(d, compaction_enabled=True)
    ids = [str(ShardId.new()) for _ in range(shards)]
    for s in ids:
        client.open(s, KEY_SCHEMA, VAL_SCHEMA)
    txns = Txns(client)
    txns.register(ids)
    schemas = Schemas.create(KEY_SCHEMA, VAL_SCHEMA)
    lat = []
    for i in range(commits):
        writes = [
            ShardWrite(s, schemas, normalize_checked(update_batch(rows, i, (i * shards + j) * rows), schemas, shard=s),
                       Antichain([i]), Antichain([i + 1]))
            for j, s in enumerate(ids)
        ]
        t0 = time.perf_counter()
        txns.commit(writes)
        lat.append(time.perf_counter() - t0)
    txns.close()
    client.close()
    return _summary(lat, shards)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commits", type=int, default=30)
    p.add_argument("--rows", type=int, default=1000)
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-txn-") as root:
        plain = {n: _plain(Path(root) / f"plain{n}", n, ns.commits, ns.rows) for n in (1, 4, 16)}
        runs = [_txn(Path(root) / f"txn{n}", n, ns.commits, ns.rows) for n in (1, 4, 16)]
    base = plain[1]
    print(f"{'write':<34}{'p50 ms':>9}{'mean ms':>9}{'commits/s':>11}{'x 1-shard caa':>15}"
          f"{'x same shards, caa each':>25}")
    for n, r in plain.items():
        r["latency_vs_baseline"] = round(r["mean_ms"] / base["mean_ms"], 2)
        name = f"caa on {n} shard(s), one by one"
        print(f"{name:<34}{r['p50_ms']:>9}{r['mean_ms']:>9}{r['commits_per_s']:>11}"
              f"{r['latency_vs_baseline']:>15}{1.0:>25}")
    for r in runs:
        r["latency_vs_baseline"] = round(r["mean_ms"] / base["mean_ms"], 2)
        r["latency_vs_plain_same_shards"] = round(r["mean_ms"] / plain[r["shards"]]["mean_ms"], 2)
        name = f"txn, {r['shards']} shard(s)"
        print(f"{name:<34}{r['p50_ms']:>9}{r['mean_ms']:>9}{r['commits_per_s']:>11}"
              f"{r['latency_vs_baseline']:>15}{r['latency_vs_plain_same_shards']:>25}")
    doc = {"rows_per_shard": ns.rows, "baseline": base, "plain": list(plain.values()), "txn": runs}
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
