"""What another engine's Parquet reader (Spark's, DuckDB's) may read of a part as it is.

``spark.direct_read`` and ``sql.direct_scan`` both hand verified part files to an
engine that decodes them itself, instead of persist decoding and consolidating them.
Two questions are the same for both and answered here: which field types such a reader
returns as the type persist would (``plain_type``), and whether a part holding several
times can still be read without consolidation (``first_key_increases``: then no
``(key, value)`` sits at two of its times).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def plain_type(t: pa.DataType) -> bool:
    """Signed integers, floats (not half), bool, strings and binary: the types another
    engine reads from a persist part as the type of persist's own Arrow column."""
    if pa.types.is_integer(t):
        return pa.types.is_signed_integer(t)
    if pa.types.is_floating(t):
        return not pa.types.is_float16(t)
    return any(
        f(t) for f in (
            pa.types.is_boolean, pa.types.is_string, pa.types.is_large_string,
            pa.types.is_binary, pa.types.is_large_binary,
        )
    )


def first_key_increases(pf: pq.ParquetFile) -> bool:
    """Whether the part's first key field strictly increases (no nulls): then no
    ``(key, value)`` sits at two of its times."""
    first = pf.read(columns=["k"], use_threads=False).column("k").combine_chunks().field(0)
    if first.null_count:
        return False
    v = first.to_numpy(zero_copy_only=False)
    return bool(np.all(v[1:] > v[:-1]))
