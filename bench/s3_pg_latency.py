"""7. S3 (moto server over HTTP) + Postgres consensus: small-write latency.

``compare_and_append`` of 10 updates (about 400 bytes of Arrow, <= 1 KiB) in a loop,
against the seed's target for operations under 1 KiB: p50 < 100 ms, p95 < 1 s.
- persist default: the tiny part (<= 4 KiB of Parquet) is stored inline in state, so a
  write is one Postgres CAS (Materialize's inline writes);
- persist with ``inline_threshold=0``: every write PUTs its part to S3 first;
- the floor: a raw 1 KiB S3 PUT to the same moto server + a raw Postgres insert.
Rollups (every 128 seqnos) are PUT to S3 in both persist modes.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from bench.common import KEY_SCHEMA, VAL_SCHEMA, Ctx, lat_summary, persist_config, row, update_batch

NAME = "s3_pg_latency"
ROWS = 10


def _persist(ctx: Ctx, blob_uri: str, pg_url: str, n: int, *, inline: bool) -> dict[str, Any]:
    from persist_lib.handles.client import PersistClient
    from persist_lib.ids import ShardId

    cfg = persist_config() if inline else persist_config(inline_threshold=0)
    client = PersistClient.open(blob_uri, pg_url, cfg)
    shard = ShardId.new()
    w = client.open_writer(shard, KEY_SCHEMA, VAL_SCHEMA)
    data = [update_batch(ROWS, i, 9000 + i) for i in range(n)]
    lat: list[float] = []
    with ctx.profile("persist_s3_pg_inline" if inline else "persist_s3_pg_blob"):
        for i, b in enumerate(data):
            t0 = time.perf_counter()
            w.compare_and_append(b, i, i + 1)
            lat.append(time.perf_counter() - t0)
    out = lat_summary(lat)
    out["arrow_bytes_per_write"] = data[0].nbytes
    info = client.inspect(shard)
    out["inline_parts"] = sum(
        1
        for b in client.machine(shard).fetch_latest().batches.values()
        for p in b.parts
        if p.inline
    )
    out["batches"] = info["num_batches"]
    client.close()
    return out


def _floor(ctx: Ctx, bucket: str, pg_url: str, n: int) -> dict[str, Any]:
    import psycopg

    s3 = ctx.moto().client()
    payload = os.urandom(1024)
    lat: list[float] = []
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE floor (k text, seqno bigint, data bytea, PRIMARY KEY (k, seqno))"
        )
        for i in range(n):
            t0 = time.perf_counter()
            s3.put_object(Bucket=bucket, Key=f"floor/{uuid.uuid4()}", Body=payload)
            conn.execute("INSERT INTO floor VALUES (%s, %s, %s)", ("s", i, payload[:600]))
            lat.append(time.perf_counter() - t0)
    return lat_summary(lat)


def run(ctx: Ctx) -> dict[str, Any]:
    n = ctx.pick(100, 500)
    moto = ctx.moto()
    bucket = moto.create_bucket("bench")
    pg_url = ctx.pg().create_database("bench_s3pg")
    det: dict[str, Any] = {"writes": n, "rows_per_write": ROWS}
    det["persist_inline"] = _persist(ctx, moto.blob_uri(bucket, "inline"), pg_url, n, inline=True)
    det["persist_s3_put"] = _persist(ctx, moto.blob_uri(bucket, "put"), pg_url, n, inline=False)
    det["floor_put_plus_insert"] = _floor(ctx, bucket, pg_url, n)
    pi, ps, fl = det["persist_inline"], det["persist_s3_put"], det["floor_put_plus_insert"]
    fname = "raw 1 KiB S3 PUT + PG insert"
    rows = [
        row(
            NAME,
            f"p50, small write (inline, default; {n} writes)",
            pi["p50_ms"],
            "ms",
            fname,
            fl["p50_ms"],
            goal_value=("<=", 100),
        ),
        row(
            NAME,
            "p95, small write (inline, default)",
            pi["p95_ms"],
            "ms",
            fname,
            fl["p95_ms"],
            goal_value=("<=", 1000),
        ),
        row(
            NAME,
            "p50, small write (part PUT to S3)",
            ps["p50_ms"],
            "ms",
            fname,
            fl["p50_ms"],
            goal_value=("<=", 100),
        ),
        row(
            NAME,
            "p95, small write (part PUT to S3)",
            ps["p95_ms"],
            "ms",
            fname,
            fl["p95_ms"],
            goal_value=("<=", 1000),
        ),
    ]
    return {"rows": rows, "detail": det}
