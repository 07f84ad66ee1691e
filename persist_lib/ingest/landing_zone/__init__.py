"""A file landing zone: a local directory or an S3 prefix of JSON-lines, CSV and Parquet files.

Files are processed in name order, one partition (``files``); the address of a
record is ``(file name, row)`` (for JSON lines the line number, for CSV the record
number after the header, for Parquet the row index). The frontier ``(f, r)`` covers
every file named before ``f`` and the first ``r`` rows of ``f``.

Producers should write a file under a temporary name (starting with ``.`` or ``_``,
or ending in ``.tmp``/``.partial``, which are ignored) and rename it into place, so a
file is never seen half written; a landed file must not change afterwards.

What can't be decided from the data alone is recorded as *notes* in the remap shard
with the binding that covers it, so every instance decides the same way:

- ``file``: a file was completed with ``rows`` rows and ``size`` bytes (the
  manifest). Replays read exactly the manifest's files; a missing or resized file is
  ``SourceDataGone``, never a silent difference.
- ``unreadable``: the file could not be opened or parsed (corrupt Parquet or gzip,
  non-UTF-8 CSV, permission denied). It becomes one error record at ``(f, 0)``.
- ``late_file``: a file appeared with a name that sorts before the frontier. It is
  *not* ingested out of order: it becomes an error record (rename it to sort after the
  frontier to ingest it) and is listed in the run summary.

The package: ``stores`` lists and reads the landed files (a local directory or an S3
prefix) and tells their format by extension; ``files`` parses a file and cuts its rows
into ``FileChunk``s; ``source`` is ``LandingZoneSource`` and its reader (which files,
in which order, with which notes).
"""

from persist_lib.ingest.landing_zone.source import LandingZoneSource

__all__ = ["LandingZoneSource"]
