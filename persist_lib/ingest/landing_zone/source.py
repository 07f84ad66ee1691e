"""The landing zone as an ingestion source: ``LandingZoneSource`` (settings, the
store) and ``LandingZoneReader``, which reads the files in name order, records what
can't be decided from the data alone (a file's manifest, an unreadable file, a late
file) as notes, and replays exactly what a binding's notes say."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from persist_lib.config_rules import Rule
from persist_lib.ingest.addresses import Address, Frontier, Note, encode_address
from persist_lib.ingest.errors import IngestConfigError, SourceDataGone, SourceUnavailable
from persist_lib.ingest.ingest_config import require_valid_settings
from persist_lib.ingest.landing_zone.files import (
    PARTITION,
    FileChunk,
    Unreadable,
    _Parsed,
    _UnreadableFile,
    parse_file,
)
from persist_lib.ingest.landing_zone.stores import FORMATS, FileInfo, _Store, format_of, open_store
from persist_lib.ingest.source import Chunk, Lag
from persist_lib.location.redaction import redacted_dataclass_repr

#: The rules of a landing zone's plain settings (the URI and format are checked apart,
#: with messages that say how to spell them).
LANDING_RULES: dict[str, Rule] = {
    "pattern": Rule("str", optional=True, meaning="an fnmatch pattern; None: every file"),
    "csv_delimiter": Rule("str", lo=1, meaning="one character"),
}


@dataclass
class LandingZoneSource:
    """A landing zone of files ingested in name order (see the package docstring).

    ``format`` is ``jsonl``, ``csv``, ``parquet`` or ``auto`` (by extension: .jsonl/
    .ndjson/.json, .csv, .parquet/.pq, each optionally .gz). ``pattern`` (fnmatch)
    restricts the files considered.
    """

    uri: str
    format: str = "auto"
    pattern: str | None = None
    csv_delimiter: str = ","
    kind: str = "landing_zone"
    _store: _Store = field(init=False, repr=False)

    def __post_init__(self) -> None:
        require_valid_settings(self, LANDING_RULES, "LandingZoneSource")
        if self.format not in (*FORMATS, "auto"):
            raise IngestConfigError(
                f"unknown file format {self.format!r}: use one of {', '.join(FORMATS)} or 'auto' "
                "(decided by each file's extension)"
            )
        if len(self.csv_delimiter) != 1:
            raise IngestConfigError(f"csv_delimiter must be one character, got {self.csv_delimiter!r}")
        self._store = open_store(self.uri)

    def __repr__(self) -> str:  # the URI may carry an S3 secret key
        return redacted_dataclass_repr(self)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "uri": self._store.describe(), "format": self.format, "pattern": self.pattern}

    def partitions(self) -> tuple[str, ...]:
        return (PARTITION,)

    def initial_frontier(self) -> Frontier:
        return {PARTITION: ("", 0)}

    def check(self) -> None:
        self._store.check()

    def prepare(self) -> None:
        self.check()

    def format_for(self, name: str) -> str | None:
        if self.format != "auto":
            return self.format
        return format_of(name)

    def wanted(self, name: str) -> bool:
        if self.pattern is not None and not fnmatch.fnmatch(name, self.pattern):
            return False
        return self.format_for(name) is not None

    def list_files(self) -> list[FileInfo]:
        return [f for f in self._store.list_files() if self.wanted(f.name)]

    def open_reader(self, frontier: Frontier, notes: list[Note]) -> LandingZoneReader:
        return LandingZoneReader(self, frontier, notes)

    def release(self, frontier: Frontier) -> None:
        return None  # files are the producer's: nothing to release

    def close(self) -> None:
        return None


class LandingZoneReader:
    def __init__(self, source: LandingZoneSource, frontier: Frontier, notes: list[Note]) -> None:
        self.src = source
        f = frontier.get(PARTITION, ("", 0))
        self._pos: Address = (str(f[0]), int(f[1]))
        self.manifest: dict[str, tuple[int, int]] = {}
        self.unreadable: dict[str, str] = {}
        self.late: set[str] = set()
        self._cur: tuple[str, _Parsed] | None = None
        self._listing: list[FileInfo] = []
        self.add_notes(notes)

    @property
    def position(self) -> Frontier:
        return {PARTITION: self._pos}

    def add_notes(self, notes: Any) -> None:
        for n in notes:
            k = n.get("kind")
            if k == "file":
                self.manifest[n["file"]] = (int(n["rows"]), int(n["size"]))
            elif k == "unreadable":
                self.unreadable[n["file"]] = n["reason"]
            elif k == "late_file":
                self.late.add(n["file"])

    # ----- parsing --------------------------------------------------------------------

    def _parse(self, name: str, *, replay: bool) -> _Parsed:
        if self._cur is not None and self._cur[0] == name:
            return self._cur[1]
        if name in self.unreadable:
            size = self.manifest.get(name, (1, 0))[1]
            parsed: _Parsed = _UnreadableFile(self.unreadable[name], size)
        else:
            fmt = self.src.format_for(name) or "jsonl"
            try:
                data = self.src._store.read(name)
            except FileNotFoundError as e:
                if replay:
                    raise SourceDataGone(
                        f"landing zone {self.src._store.describe()}: file {name!r} is bound in the "
                        "remap shard but no longer exists; restore it, or rebuild the collection "
                        "in a new rendition (from the raw collection if kept)"
                    ) from e
                raise SourceUnavailable(f"file {name!r} disappeared while reading it") from e
            except (PermissionError, IsADirectoryError) as e:
                if replay:
                    raise SourceUnavailable(f"cannot read bound file {name!r}: {e}") from e
                parsed = _UnreadableFile(f"cannot read the file: {e}", 0)
                self._cur = (name, parsed)
                return parsed
            except OSError as e:
                raise SourceUnavailable(f"cannot read {name!r}: {e}") from e
            try:
                parsed = parse_file(name, data, fmt, csv_delimiter=self.src.csv_delimiter)
            except Unreadable as e:
                if replay and name not in self.unreadable:
                    # It was readable when bound, so its bytes changed since.
                    raise SourceDataGone(
                        f"bound file {name!r} can no longer be parsed ({e}); it changed after it "
                        "was ingested: restore it or rebuild in a new rendition"
                    ) from e
                parsed = _UnreadableFile(str(e), len(data))
            if replay and name in self.manifest:
                rows, size = self.manifest[name]
                if parsed.size != size or parsed.rows != rows:
                    raise SourceDataGone(
                        f"bound file {name!r} changed after it was ingested (was {rows} rows / "
                        f"{size} bytes, now {parsed.rows} rows / {parsed.size} bytes); landed files "
                        "must not change: restore it or rebuild in a new rendition"
                    )
        self._cur = (name, parsed)
        return parsed

    def _chunk(self, name: str, parsed: _Parsed, r0: int, r1: int, *, minting: bool) -> FileChunk:
        notes: tuple[Note, ...] = ()
        if minting and r1 >= parsed.rows:
            ns: list[Note] = []
            if isinstance(parsed, _UnreadableFile):
                ns.append({"kind": "unreadable", "file": name, "reason": parsed.reason})
            ns.append({"kind": "file", "file": name, "rows": parsed.rows, "size": parsed.size})
            notes = tuple(ns)
        return FileChunk(name, parsed, r0, r1, notes)

    # ----- reading --------------------------------------------------------------------

    def read(self, upto: Frontier | None, max_records: int) -> list[Chunk]:
        if upto is not None:
            return self._replay(tuple(upto[PARTITION]), max_records)
        return self._read_new(max_records)

    def _replay(self, upto: Address, max_records: int) -> list[Chunk]:
        """Reads ``[position, upto)`` exactly as bound: the manifest's files, then ``upto``'s."""
        uf, ur = str(upto[0]), int(upto[1])
        out: list[Chunk] = []
        budget = max_records
        while budget > 0 and self._pos < (uf, ur):
            f, r = self._pos
            if f == uf:
                name, start, end = f, r, ur
            elif f in self.manifest and r < self.manifest[f][0]:
                name, start, end = f, r, self.manifest[f][0]
            else:
                if f and r > 0 and f not in self.manifest:
                    raise SourceDataGone(
                        f"the remap shard binds past file {f!r} but records no row count for it; "
                        "the bindings are inconsistent with this source"
                    )
                nxt = min((n for n in self.manifest if f < n < uf), default=None)
                if nxt is not None:
                    name, start, end = nxt, 0, self.manifest[nxt][0]
                elif ur > 0:
                    name, start, end = uf, 0, ur
                else:
                    self._pos = (uf, ur)
                    break
            parsed = self._parse(name, replay=True)
            if end > parsed.rows:
                raise SourceDataGone(
                    f"bound file {name!r} has {parsed.rows} rows but the remap shard binds up to row "
                    f"{end}; it changed after it was ingested: restore it or rebuild in a new rendition"
                )
            stop = min(end, start + budget)
            if stop > start:
                out.append(self._chunk(name, parsed, start, stop, minting=False))
                budget -= stop - start
            self._pos = (name, stop)
            if stop >= parsed.rows:
                self._cur = None
        return out

    def _read_new(self, max_records: int) -> list[Chunk]:
        """Reads about ``max_records`` records past the position, noting what it decides."""
        listing = self.src.list_files()
        self._listing = listing
        names = {i.name for i in listing}
        out: list[Chunk] = []
        f, r = self._pos
        if f and f not in names and f not in self.manifest:
            # The partly ingested file vanished: record what was read, definitely.
            reason = (
                f"file {f!r} disappeared after {r} of its rows were ingested; the rest of it "
                "was not ingested"
            )
            notes: tuple[Note, ...] = (
                {"kind": "file", "file": f, "rows": r, "size": -1},
                {"kind": "vanished", "file": f,
                 "error": {"partition": PARTITION, "address": [f, r], "kind": "vanished_file", "reason": reason}},
            )
            out.append(FileChunk(f, _UnreadableFile(reason, 0), r, r, notes))
            self.manifest[f] = (r, -1)
        budget = max_records
        for info in listing:
            if budget <= 0:
                break
            name = info.name
            f, r = self._pos
            if name < f:
                continue
            if name in self.manifest and (name != f or r >= self.manifest[name][0]):
                continue  # completed before
            start = r if name == f else 0
            parsed = self._parse(name, replay=False)
            if start > parsed.rows:
                raise SourceDataGone(
                    f"file {name!r} has {parsed.rows} rows but the frontier is at row {start}; it "
                    "shrank after it was partly ingested"
                )
            stop = min(parsed.rows, start + budget)
            chunk = self._chunk(name, parsed, start, stop, minting=True)
            out.append(chunk)
            budget -= stop - start
            self._pos = (name, stop)
            if stop < parsed.rows:
                break
            self._cur = None
            self.manifest[name] = (parsed.rows, parsed.size)
        return out

    def observe(self) -> list[Note]:
        """Late files: listed, named before the frontier, never bound. Not ingested."""
        f, _ = self._pos
        notes: list[Note] = []
        for info in self._listing:
            if info.name >= f:
                break
            if info.name in self.manifest or info.name in self.late:
                continue
            reason = (
                f"late file: {info.name!r} arrived after the ingestion frontier had passed its name "
                f"(frontier at {encode_address(self._pos)}); files are ingested in name order, so it "
                "was not ingested: rename it to sort after the frontier to ingest it"
            )
            notes.append(
                {
                    "kind": "late_file",
                    "file": info.name,
                    "size": info.size,
                    "error": {"partition": PARTITION, "address": [info.name, 0], "kind": "late_file", "reason": reason},
                }
            )
            self.late.add(info.name)
        return notes

    def lag(self) -> Lag:
        f, r = self._pos
        behind = 0
        files = 0
        for info in self._listing:
            if info.name < f:
                continue
            if info.name == f:
                rows = self.manifest.get(f, (0, 0))[0] or (self._cur[1].rows if self._cur and self._cur[0] == f else 0)
                if rows:
                    behind += int(info.size * max(rows - r, 0) / rows)
                continue
            behind += info.size
            files += 1
        return Lag(bytes_behind=behind, detail={"files_behind": files})

    def close(self) -> None:
        self._cur = None

