"""File-source ingestion throughput at 1M records (records/s and MB/s), per format.

Run: ``.venv/bin/python -m bench.ingest_throughput [--records 1000000] [--files 10]
[--formats jsonl,csv,parquet] [--envelope append_only|upsert] [--keep-raw] [--out FILE]``.

For each format it writes ``--records`` records into ``--files`` landing-zone files,
then measures, back to back on the same disk:

- **ingest**: ``Ingestion.run_once()`` on the embedded default location (file blob +
  SQLite consensus): listing, reading, schema-checked decoding, the envelope, the
  remap bindings and verified definite appends of data/errors(/raw/state);
- **anchor**: the physical floor of the same job: parse the files with the same
  library (pyarrow.json / Python csv / pyarrow.parquet) and write one Parquet file.

It prints JSON and a table; ``ratio`` = ingest time / anchor time. Figures on a
shared machine are noisy: compare the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string()), ("qty", pa.float64()), ("city", pa.string())])


def make_files(root: Path, fmt: str, records: int, files: int, seed: int = 1) -> int:
    """Writes the landing zone; returns its size in bytes."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per = records // files
    cities = np.array(["Berlin", "Lisbon", "Osaka", "Quito", "Accra", "Perth"])
    total = 0
    for f in range(files):
        n = per if f < files - 1 else records - per * (files - 1)
        ids = np.arange(f * per, f * per + n, dtype=np.int64)
        qty = np.round(rng.random(n) * 1000, 2)
        city = cities[rng.integers(0, len(cities), n)]
        t = pa.table({"id": ids, "name": [f"name-{i}" for i in ids], "qty": qty, "city": city})
        path = root / f"part-{f:05d}.{fmt}"
        if fmt == "jsonl":
            with open(path, "w") as fh:
                for i, nm, q, c in zip(ids.tolist(), t["name"].to_pylist(), qty.tolist(), city.tolist(), strict=True):
                    fh.write(f'{{"id": {i}, "name": "{nm}", "qty": {q}, "city": "{c}"}}\n')
        elif fmt == "csv":
            with open(path, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["id", "name", "qty", "city"])
                w.writerows(zip(ids.tolist(), t["name"].to_pylist(), qty.tolist(), city.tolist(), strict=True))
        else:
            pq.write_table(t, path)
        total += path.stat().st_size
    return total


def anchor(root: Path, fmt: str, out: Path) -> float:
    """Parse every file with the same library and write one Parquet file: the floor."""
    t0 = time.perf_counter()
    tables = []
    schema = pa.schema(list(KEY) + list(VAL))
    for p in sorted(root.iterdir()):
        if fmt == "jsonl":
            tables.append(pj.read_json(p, parse_options=pj.ParseOptions(explicit_schema=schema)))
        elif fmt == "csv":
            with open(p, newline="") as fh:
                rows = list(csv.reader(io.StringIO(fh.read())))[1:]
            cols = list(zip(*rows, strict=True))
            tables.append(
                pa.table({n: pa.array(c, pa.string()) for n, c in zip(schema.names, cols, strict=True)}).cast(schema)
            )
        else:
            tables.append(pq.read_table(p))
    pq.write_table(pa.concat_tables(tables), out)
    return time.perf_counter() - t0


def ingest(root: Path, home: Path, envelope: str, keep_raw: bool, per_binding: int) -> tuple[float, dict[str, Any]]:
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource

    client = PersistClient.default(home, PersistConfig(background_heartbeats=False))
    t0 = time.perf_counter()
    with Ingestion(
        client, "bench", LandingZoneSource(str(root)), KEY, VAL, envelope=envelope,
        config=IngestConfig(max_records_per_binding=per_binding, keep_raw=keep_raw),
    ) as ing:
        summary = ing.run_once()
    dt = time.perf_counter() - t0
    client.close()
    return dt, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--formats", default="jsonl,csv,parquet")
    ap.add_argument("--envelope", default="append_only", choices=["append_only", "upsert"])
    ap.add_argument("--keep-raw", action="store_true")
    ap.add_argument("--records-per-binding", type=int, default=100_000)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ns = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="ingest-bench-", dir=os.environ.get("BENCH_ROOT")))
    results = []
    try:
        for fmt in ns.formats.split(","):
            zone = base / f"zone-{fmt}"
            size = make_files(zone, fmt, ns.records, ns.files)
            a = anchor(zone, fmt, base / f"anchor-{fmt}.parquet")
            dt, s = ingest(zone, base / f"home-{fmt}", ns.envelope, ns.keep_raw, ns.records_per_binding)
            assert s["records"] == ns.records and s["errors"] == 0, s
            results.append(
                {
                    "format": fmt,
                    "records": ns.records,
                    "input_mb": round(size / 1e6, 1),
                    "ingest_s": round(dt, 2),
                    "records_per_s": round(ns.records / dt),
                    "mb_per_s": round(size / 1e6 / dt, 1),
                    "anchor_s": round(a, 2),
                    "anchor_records_per_s": round(ns.records / a),
                    "ratio": round(dt / a, 2),
                    "bindings": s["bindings_minted"],
                    "envelope": ns.envelope,
                    "keep_raw": ns.keep_raw,
                }
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc = {"benchmark": "ingest_throughput", "python": sys.version.split()[0], "pyarrow": pa.__version__, "results": results}
    print(json.dumps(doc, indent=2))
    hdr = f"| {'format':8} | {'records':>9} | {'MB':>7} | {'ingest s':>8} | {'rec/s':>9} | {'MB/s':>6} | {'anchor s':>8} | {'ratio':>5} |"
    print()
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r in results:
        print(
            f"| {r['format']:8} | {r['records']:>9,} | {r['input_mb']:>7} | {r['ingest_s']:>8} | "
            f"{r['records_per_s']:>9,} | {r['mb_per_s']:>6} | {r['anchor_s']:>8} | {r['ratio']:>5} |"
        )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
