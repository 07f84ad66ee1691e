"""CSV records: parsing a landing-zone CSV text record by record, and decoding the
records into typed rows (the rebuild from raw decodes them the same way).

A record that does not parse (a quoting error, a field over Python's 128 KiB limit) is
an ``invalid_csv`` error of its own: the file's other records still count. Bytes that
are not UTF-8 arrive as lone surrogates (``surrogateescape``) and make their record an
``invalid_utf8`` error; the rest of the file is ingested.
"""

from __future__ import annotations

import csv
import io
import re

import pyarrow as pa

from persist_lib.ingest.decode import DecodeSpec, decode_text_columns, merge_good_and_bad


def read_csv_records(text: str, delimiter: str) -> tuple[list[list[str]], dict[int, tuple[str, bytes]]]:
    """The records of a CSV text (the header first), and the ones that don't parse:
    ``{index: (reason, raw bytes)}``, each standing as an empty record in the list. A
    quoting error costs only its record; an unterminated quote takes the rest of the
    file with it (CSV can't tell where its field would end)."""
    lines = list(io.StringIO(text, newline=""))
    reader = csv.reader(iter(lines), delimiter=delimiter, strict=True)
    records: list[list[str]] = []
    unparsed: dict[int, tuple[str, bytes]] = {}
    while True:
        start = reader.line_num
        try:
            rec = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raw = "".join(lines[start : reader.line_num]).rstrip("\r\n")
            unparsed[len(records)] = (
                f"the CSV record can't be parsed (line {start + 1}): {e}",
                raw.encode("utf-8", errors="surrogateescape"),
            )
            rec = []
        records.append(rec)
    return records, unparsed


# What ``bytes.decode("utf-8", "surrogateescape")`` turns bytes that are not UTF-8 into.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _not_utf8(header: list[str], rec: list[str]) -> str:
    j = next(j for j, v in enumerate(rec) if _NOT_UTF8.search(v))
    b = rec[j].encode("utf-8", errors="surrogateescape")
    name = repr(header[j]) if j < len(header) else f"#{j + 1}"
    return f"field {name} is not valid UTF-8 (bytes {b[:60]!r})"


def decode_csv_records(
    spec: DecodeSpec,
    header: list[str],
    recs: list[list[str]],
    unparsed: dict[int, str] | None = None,
    *,
    not_utf8: bool = True,
) -> tuple[pa.Table, list[tuple[int, str, str]]]:
    """Rows for the well-formed CSV records, ``(index, kind, reason)`` for the others.

    Blank records yield nothing; ``unparsed`` records (empty in ``recs``) are
    ``invalid_csv`` with their reason; records holding bytes that are not UTF-8 (as
    lone surrogates) are ``invalid_utf8`` (``not_utf8=False``: the caller knows there
    are none, the search is skipped). Row-wise: a record decodes the same in any batch.
    """
    width = len(header)
    bad_text = (
        {i: _not_utf8(header, r) for i, r in enumerate(recs) if _NOT_UTF8.search("".join(r))} if not_utf8 else {}
    )
    ok_idx = [i for i, r in enumerate(recs) if len(r) == width and i not in bad_text]
    bad_width = [
        (i, "wrong_field_count", f"expected {width} fields (header {header}), got {len(r)}")
        for i, r in enumerate(recs)
        if len(r) != width and len(r) != 0 and i not in bad_text
    ]
    bad_width += [(i, "invalid_utf8", reason) for i, reason in bad_text.items()]
    bad_width += [(i, "invalid_csv", reason) for i, reason in (unparsed or {}).items()]
    good = [recs[i] for i in ok_idx]
    cols: dict[str, pa.Array] = {}
    wanted = {f.name for f in spec.input_fields()}
    for j, h in enumerate(header):
        if h in wanted and h not in cols:
            cols[h] = pa.array([r[j] for r in good], pa.string())
    table, bad = decode_text_columns(spec, cols, len(good))
    rows, bad2 = merge_good_and_bad(spec, len(good), table, bad)
    all_bad = [(ok_idx[i], k, r) for i, k, r in bad2] + bad_width
    all_bad.sort()
    return rows, all_bad
