"""Large parts compute their statistics on another thread while they encode
(``batch_builder.MIN_PARALLEL_STATS_ROWS``): the recorded statistics are those of the
part's rows, as for small parts computed inline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from persist_lib.shard import batch_builder
from persist_lib.shard.codec import Schemas
from persist_lib.shard.parts import fetch_part
from persist_lib.shard.stats import part_stats
from tests.test_spark_support import file_location, open_client

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("score", pa.float64())])


def test_parallel_and_inline_statistics_are_the_parts_own(tmp_path: Path) -> None:
    client = open_client(file_location(tmp_path), inline_threshold=0, blob_target_size=64 << 20)
    w, r = client.open("s00000000-0000-4000-8000-0000000000d1", KEY, VAL)
    rng = np.random.default_rng(7)
    for t, n in enumerate((batch_builder.MIN_PARALLEL_STATS_ROWS + 5, 100)):  # parallel, inline
        ids = rng.integers(-(10**9), 10**9, n)
        w.compare_and_append(
            pa.table({
                "id": ids, "name": [f"n{i % 977}" for i in ids], "score": rng.random(n),
                "ts": [t] * n, "diff": [1] * n,
            }),
            t, t + 1,
        )
    schemas = Schemas(KEY, VAL)
    parts = [p for _, b in client.machine(r.shard_id).fetch_latest().trace_batches() for p in b.parts]
    assert max(p.count for p in parts) >= batch_builder.MIN_PARALLEL_STATS_ROWS > min(p.count for p in parts)
    for p in parts:
        assert p.stats is not None
        assert p.stats == part_stats(fetch_part(client.blob, p, schemas, r.shard_id), schemas)
        assert {c for c, *_ in p.stats} == {"t", "k.id", "v.name", "v.score"}
    client.close()
