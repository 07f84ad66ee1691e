"""The write-side cost of per-part statistics (``shard.stats``, issue 28).

One ``compare_and_append`` of 1M (full: 5M) updates into a new shard (file blob +
SQLite, durable), with statistics recorded (the default) and without, alternated
(with, without, with, ...; 3 each (full: 2), median): the batch builder's
``part_stats`` is what differs (``record_stats=False`` leaves ``PartMeta.stats``
None). Also the time of ``part_stats`` alone over the same rows. Run alone:
``python -m bench --only stats_cost``.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from bench.common import KEY_SCHEMA, VAL_SCHEMA, Ctx, persist_file_client, row, update_batch

NAME = "stats_cost"


def _append(ctx: Ctx, table: Any, tag: str) -> float:
    from persist_lib.ids import ShardId

    client = persist_file_client(ctx.dir(f"stats_cost_{tag}"))
    try:
        w = client.open_writer(ShardId.new(), KEY_SCHEMA, VAL_SCHEMA)
        gc.collect()
        t0 = time.perf_counter()
        w.compare_and_append(table, 0, 1)
        return time.perf_counter() - t0
    finally:
        client.close()


def run(ctx: Ctx) -> dict[str, Any]:
    from persist_lib.shard import batch_builder
    from persist_lib.shard.codec import Schemas, normalize_updates
    from persist_lib.shard.stats import part_stats

    n = ctx.pick(1_000_000, 5_000_000)
    reps = ctx.pick(3, 2)
    table = update_batch(n, 0, 99)
    real = batch_builder.part_stats
    with_s: list[float] = []
    without_s: list[float] = []
    for i in range(reps):
        with_s.append(_append(ctx, table, f"with{i}"))
        batch_builder.part_stats = lambda *a, **k: None  # type: ignore[assignment]
        try:
            without_s.append(_append(ctx, table, f"without{i}"))
        finally:
            batch_builder.part_stats = real  # type: ignore[assignment]
    schemas = Schemas(KEY_SCHEMA, VAL_SCHEMA)
    internal = normalize_updates(table, schemas, shard="stats_cost")
    alone: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        part_stats(internal, schemas)
        alone.append(time.perf_counter() - t0)
    w, wo, a = statistics.median(with_s), statistics.median(without_s), statistics.median(alone)
    mb = table.nbytes / 1e6
    det = {"rows": n, "with_s": with_s, "without_s": without_s, "part_stats_alone_s": alone}
    rows = [
        row(NAME, f"bulk append ({n / 1e6:g}M rows), MB/s of Arrow, with statistics", mb / w, "MB/s",
            "the same without statistics", mb / wo,
            note=f"part_stats alone {a * 1e3:.1f} ms = {a / w:.1%} of the append"),
    ]
    return {"rows": rows, "detail": det}
