"""Reading only the row groups of a part a read needs, every byte verified (issue 28).

``fetch_part_groups(blob, part, schemas, shard, keep)`` reads an indexed part
(``shard.part_index``) in ranged GETs: its footer (checked against the SHA-256 state
records for it), then the row groups ``keep(rows, stats)`` accepts — adjacent ones in
one GET — each checked against the SHA-256 the verified footer records for it, and
decodes those groups. ``keep`` sees a group's row count and its column statistics from
the footer (``ColumnStats`` by internal column; a column without an entry may hold
anything) and returns False only when no row of the group can matter to the read.

Parts without an index (written before it, inline in state, unsorted bulk parts) and
reads that prune nothing (``keep`` None) take the whole-part path of ``parts.fetch_part``.
A part whose footer is damaged fails with ``CorruptionError``, as does a row group
whose bytes don't match: nothing is decoded from unverified bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from persist_lib.errors import BlobNotFound, CorruptionError
from persist_lib.location.base import Blob
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.codec import Schemas, internal_schema
from persist_lib.shard.migrate import migrate
from persist_lib.shard.part_fetch import check_part_metadata, raw_to_internal
from persist_lib.shard.part_index import (
    OpenedPart,
    group_stat_columns,
    group_stats,
    open_footer,
    place_group,
)
from persist_lib.shard.parts import check_part_strings, fetch_part
from persist_lib.shard.stats import ColumnStats

# ``keep(rows, stats)``: whether a row group of ``rows`` rows with these statistics may
# hold rows the read needs.
GroupFilter = Callable[[int, dict[str, ColumnStats]], bool]


def _missing(shard: str, key: str) -> BlobNotFound:
    return BlobNotFound(
        f"shard {shard}: part {key} is missing: it was deleted (garbage collected while still "
        "referenced?) or never written; re-read the shard state and retry from a newer seqno"
    )


def fetch_part_groups(
    blob: Blob, part: PartMeta, schemas: Schemas, shard: str, keep: GroupFilter | None
) -> pa.Table:
    """The rows of ``part``'s row groups that ``keep`` accepts, verified and decoded
    (internal layout, in the part's order); the whole part when it has no index or
    ``keep`` is None."""
    if keep is None or part.footer is None or part.key is None or part.inline is not None:
        return fetch_part(blob, part, schemas, shard)
    key = part.key
    length = part.footer[0]
    if not 0 < length <= part.size:
        raise CorruptionError(f"shard {shard}: part {key}: recorded footer length {length} of a {part.size}-byte part")
    footer = blob.get_range(key, part.size - length, part.size)
    if footer is None:
        raise _missing(shard, key)
    opened = open_footer(footer, part.size, part.footer, shard=shard, key=key)
    written = check_part_metadata(opened.file, schemas, shard, key)  # an earlier version's?
    columns = group_stat_columns(written)
    chosen = [i for i in range(opened.num_groups) if keep(*group_stats(opened, i, columns))]
    if not chosen:
        return internal_schema(schemas).empty_table()
    _fetch_groups(blob, opened, chosen, shard, key)
    try:
        if len(chosen) == opened.num_groups:
            raw = opened.file.read(use_threads=part.size > (1 << 20))
        else:
            raw = opened.file.read_row_groups(chosen, use_threads=len(chosen) > 1)
    except Exception as e:  # verified bytes that don't decode
        raise CorruptionError(
            f"shard {shard}: part {key}: cannot decode Parquet ({type(e).__name__}: {e}); the blob "
            "was altered or truncated; nothing was returned. Stop and investigate the blob store"
        ) from e
    table = raw_to_internal(raw, written, internal_schema(written), shard, key)
    check_part_strings(table, written, shard, key)
    return migrate(table, written, schemas)  # to the reader's layout


def _fetch_groups(blob: Blob, opened: OpenedPart, chosen: list[int], shard: str, key: str) -> None:
    """Fetches the chosen row groups, adjacent ones in one ranged GET, and puts each in
    place once its bytes match the footer's hash."""
    spans: list[list[int]] = []
    for i in chosen:
        if spans and spans[-1][-1] == i - 1:
            spans[-1].append(i)
        else:
            spans.append([i])
    for span in spans:
        lo, hi = opened.ranges[span[0]][0], opened.ranges[span[-1]][1]
        data = blob.get_range(key, lo, hi)
        if data is None:
            raise _missing(shard, key)
        if len(data) != hi - lo:
            raise CorruptionError(
                f"shard {shard}: part {key}: bytes [{lo}, {hi}) came back as {len(data)} bytes; the "
                "blob was truncated; nothing was returned. Stop and investigate the blob store"
            )
        view = memoryview(data)
        for i in span:
            a, b = opened.ranges[i]
            place_group(opened, i, view[a - lo : b - lo], shard=shard, key=key)
