"""``persist snapshot`` and ``persist tail``: read a collection or a shard from the shell.

- ``persist snapshot NAME_OR_SHARD [--as-of TIME] [--limit N] [--json]``: the contents
  at ``TIME`` (default: the latest complete time, ``upper - 1``), streamed with
  ``snapshot_batches``: rows are printed as they are read, so a large collection prints
  progressively in bounded memory (``--memory-budget``).
- ``persist tail NAME_OR_SHARD [--from TIME] [--until TIME] [--snapshot] [--json]``: a
  listen printing every update after ``TIME`` (default: the latest complete time) as it
  arrives: ``ts``, ``diff``, then the key and value columns. Ctrl-C (or SIGTERM) stops it
  cleanly; ``--until`` stops once every update at times up to ``TIME`` is printed.

``NAME_OR_SHARD`` is a shard id (``s<uuid>``) or a STORAGE collection name (read through
a collection reader, across handovers). ``TIME`` is an integer or an ISO-8601 timestamp
(UTC unless it says otherwise), taken as ms since the epoch. Both commands register one
leased reader (a collection: one on its metadata shard and one per rendition shard
read) and release it on every way out (end, ``--limit``, Ctrl-C, a closed pipe, an
error); a location that does not exist is never created. ``--json`` prints one JSON
object per row (JSON Lines), with ``ts`` and ``diff``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import decimal
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import pyarrow as pa

from persist_lib.cli.fit import elide, fit_widths, line_width
from persist_lib.cli.main import command
from persist_lib.cli.values import bytes_text
from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain
from persist_lib.handles.client import PersistClient
from persist_lib.handles.listen import ListenProgress, ListenUpdates
from persist_lib.ids import ShardId
from persist_lib.shard.codec import Schemas
from persist_lib.timefmt import frontier_text, parse_time, time_text

MiB = 1 << 20
#: Rows converted to Python at once while printing (bounds the memory of printing).
PRINT_CHUNK = 1024
#: Rows whose widths set the columns of a streamed table.
WIDTH_SAMPLE = 200


# ----- what to read --------------------------------------------------------------------


@dataclass
class Target:
    """An open reader of a shard or a collection, and what to say about it."""

    label: str
    schemas: Schemas
    reader: Any  # ReadHandle | CollectionReader: snapshot_batches(), listen(), expire()
    upper: Callable[[], Antichain]
    since: Callable[[], Antichain]
    note: Callable[[int], str]  # extra words about a time (a collection: its rendition)


def _is_shard_id(text: str) -> bool:
    try:
        ShardId.parse(text)
    except (InvalidUsage, ValueError):
        return False
    return True


@contextmanager
def open_target(client: PersistClient, name_or_shard: str, purpose: str) -> Iterator[Target]:
    """A reader of ``name_or_shard``, released (expired) on the way out, whatever happens."""
    if _is_shard_id(name_or_shard):
        sid = str(ShardId.parse(name_or_shard))
        m = client.machine(sid)
        st = m.fetch_latest()
        if not st.exists:
            raise InvalidUsage(f"shard {sid} does not exist at this location (see persist shards)")
        if st.tombstone:
            raise InvalidUsage(f"shard {sid} was finalized: it holds no data any more")
        if st.schemas is None:
            raise InvalidUsage(f"shard {sid} has no schemas yet: nothing was ever registered on it")
        schemas = Schemas.from_json(st.schemas)
        reader = client.open_leased_reader(sid, schemas.key, schemas.val, purpose=purpose)
        try:
            yield Target(
                label=f"shard {sid}",
                schemas=schemas,
                reader=reader,
                upper=lambda: m.fetch_latest().upper,
                since=lambda: reader.since,
                note=lambda t: "",
            )
        finally:
            reader.expire()
        return
    from persist_lib.storage import StorageController

    with StorageController(client, read_only=True) as ctl:
        name = name_or_shard
        coll = ctl.acquire_read_handle(name)

        def upper() -> Antichain:
            d = ctl.describe(name)
            meta = Antichain(d["metadata_upper"])
            active = d["active_rendition"]
            if active is None:
                return Antichain([0])
            return min(meta, Antichain(d["renditions"][active]["upper"] or []))

        def note(t: int) -> str:
            try:
                return f", rendition {coll.active_rendition(t, timeout_s=0.0)}"
            except Exception:  # noqa: BLE001 - only words for the header
                return ""

        try:
            yield Target(
                label=f"collection {name}",
                schemas=coll.schemas,
                reader=coll,
                upper=upper,
                since=lambda: coll.since,
                note=note,
            )
        finally:
            coll.expire()


def _latest(t: Target) -> int | None:
    """The latest complete time (``upper - 1``); None before anything was written."""
    upper = t.upper()
    if upper.is_empty():
        raise InvalidUsage(
            f"{t.label}: its upper is closed (no more writes): give a time with --as-of/--from"
        )
    u = upper.time
    assert u is not None
    return None if u == 0 else u - 1


def _check_readable(t: Target, as_of: int) -> None:
    upper = t.upper()
    if not upper.is_empty() and upper.time is not None and as_of >= upper.time:
        latest = "nothing is written yet" if upper.time == 0 else f"the latest is {time_text(upper.time - 1)}"
        raise InvalidUsage(
            f"{t.label}: time {time_text(as_of)} is not complete yet (upper {frontier_text(upper.elements)}; "
            f"{latest}); use an earlier --as-of, or persist tail to follow new updates"
        )
    since = t.since()
    if since.is_empty() or not since.less_equal(as_of):
        raise InvalidUsage(
            f"{t.label}: time {time_text(as_of)} is before the since {frontier_text(since.elements)}: "
            "history before it was compacted away; read at a time >= the since"
        )


# ----- printing ------------------------------------------------------------------------


def _value_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, bytes):
        return bytes_text(v)  # text when UTF-8, escaped otherwise (--json: hex)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, list | dict):
        return json.dumps(v, default=str)
    return str(v).replace("\n", "\\n")


def _json_default(v: Any) -> Any:
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


class RowPrinter:
    """Prints rows as they stream: an aligned table (widths from the first rows, fitted
    to 120 columns by ``persist_lib.cli.fit``; a later, longer cell pushes its line out
    up to that width, then ends in ``…``) or JSON Lines."""

    def __init__(
        self,
        columns: Sequence[str],
        out: IO[str],
        *,
        as_json: bool,
        formatters: dict[str, Callable[[Any], str]] | None = None,
    ) -> None:
        self.columns = list(columns)
        self.out = out
        self.as_json = as_json
        self.formatters = formatters or {}
        self.widths: list[int] | None = None
        self.rows = 0

    def _cells(self, row: dict[str, Any]) -> list[str]:
        return [self.formatters.get(c, _value_text)(row.get(c)) for c in self.columns]

    def print_table(self, table: pa.Table | pa.RecordBatch, limit: int | None = None) -> int:
        """Prints (up to ``limit``) rows of ``table`` chunk by chunk; returns how many."""
        n = table.num_rows if limit is None else min(table.num_rows, limit)
        printed = 0
        for off in range(0, n, PRINT_CHUNK):
            rows = table.slice(off, min(PRINT_CHUNK, n - off)).to_pylist()
            self.print_rows(rows)
            printed += len(rows)
        return printed

    def print_rows(self, rows: list[dict[str, Any]]) -> None:
        if self.as_json:
            for r in rows:
                self.out.write(json.dumps(r, default=_json_default) + "\n")
        else:
            cells = [self._cells(r) for r in rows]
            if self.widths is None:
                sample = cells[:WIDTH_SAMPLE]
                self.widths = fit_widths(
                    [max([len(c)] + [len(r[i]) for r in sample]) for i, c in enumerate(self.columns)],
                    [c not in ("ts", "diff") for c in self.columns],
                )
                self.out.write(self._line(self.columns) + "\n")
                self.out.write("  ".join("-" * w for w in self.widths) + "\n")
            for c in cells:
                self.out.write(self._line(c) + "\n")
        self.rows += len(rows)

    def header_only(self) -> None:
        """The header of an empty table (text only)."""
        if not self.as_json and self.widths is None:
            self.widths = [len(c) for c in self.columns]
            self.out.write(self._line(self.columns) + "\n")
            self.out.write("  ".join("-" * w for w in self.widths) + "\n")

    def _line(self, cells: Sequence[str]) -> str:
        """One row: a later, longer cell pushes the line out while it still fits the line
        width; beyond it, text cells are cut to their column (``ts`` and ``diff`` never)."""
        assert self.widths is not None
        whole = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=False)).rstrip()
        if len(whole) <= line_width():
            return whole
        return "  ".join(
            (c if col in ("ts", "diff") else elide(c, w)).ljust(w)
            for c, w, col in zip(cells, self.widths, self.columns, strict=False)
        ).rstrip()


def _diff_text(d: Any) -> str:
    return f"{d:+d}" if isinstance(d, int) else _value_text(d)


def _ts_text(t: Any) -> str:
    return time_text(t) if isinstance(t, int) else _value_text(t)


def _say(text: str) -> None:
    """A note for people on stderr (never mixed into the rows on stdout)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# ----- persist snapshot ------------------------------------------------------------------


def _time_arg(text: str) -> int:
    try:
        return parse_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _target_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="NAME_OR_SHARD", help="a collection name or a shard id (s<uuid>)")


def _snapshot_args(p: argparse.ArgumentParser) -> None:
    _target_arg(p)
    p.add_argument(
        "--as-of",
        type=_time_arg,
        default=None,
        metavar="TIME",
        help="the time to read at: an integer or an ISO-8601 timestamp such as "
        "2026-01-01T12:00:00Z (UTC unless a zone is given); default: the latest complete "
        "time (upper - 1)",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="print at most N rows")
    p.add_argument(
        "--memory-budget",
        type=int,
        default=64,
        metavar="MB",
        help="memory for the streaming read, per shard (default 64 MB)",
    )


@command(
    "snapshot",
    "print a collection's or a shard's contents at a time (streamed: big ones print "
    "progressively, in bounded memory)",
    _snapshot_args,
)
def _cmd_snapshot(client: PersistClient, ns: argparse.Namespace) -> Any:
    if ns.limit is not None and ns.limit < 0:
        raise InvalidUsage(f"--limit {ns.limit}: give a number >= 0")
    out = sys.stdout
    with open_target(client, ns.target, "persist snapshot") as t:
        as_of = ns.as_of
        if as_of is None:
            as_of = _latest(t)
            if as_of is None:
                raise InvalidUsage(f"{t.label}: nothing is written yet (its upper is 0)")
        _check_readable(t, as_of)
        names = t.schemas.key_names + t.schemas.val_names
        printer = RowPrinter(
            (names + ["ts", "diff"]) if ns.json else (names + ["diff"]),
            out,
            as_json=ns.json,
            formatters={"diff": _diff_text, "ts": _ts_text},
        )
        if not ns.json:
            _say(f"{t.label} as of {time_text(as_of)}{t.note(as_of)}")
        limit = ns.limit
        stopped = False
        budget = max(1, ns.memory_budget) * MiB
        with t.reader.snapshot_batches(as_of, memory_budget=budget, timeout_s=10.0) as stream:
            for batch in stream:
                if limit is not None and printer.rows >= limit:
                    stopped = True
                    break
                printer.print_table(batch, None if limit is None else limit - printer.rows)
                out.flush()
                client.heartbeat_due()  # a long read keeps its lease
        if printer.rows == 0:
            printer.header_only()
        out.flush()
        if not ns.json:
            more = f" (stopped at --limit {limit})" if stopped or (limit is not None and printer.rows >= limit) else ""
            _say(f"{printer.rows:,} row(s){more}")
    return None


# ----- persist tail ---------------------------------------------------------------------


def _tail_args(p: argparse.ArgumentParser) -> None:
    _target_arg(p)
    p.add_argument(
        "--from",
        dest="from_",
        type=_time_arg,
        default=None,
        metavar="TIME",
        help="print the updates at times after TIME (an integer or an ISO-8601 timestamp); "
        "default: the latest complete time, so only new updates are printed",
    )
    p.add_argument(
        "--until",
        type=_time_arg,
        default=None,
        metavar="TIME",
        help="stop once every update at times up to TIME has been printed (default: run until "
        "interrupted, or until the upper is closed)",
    )
    p.add_argument(
        "--snapshot",
        action="store_true",
        help="first print the contents at the start time (as updates at that time)",
    )


@command(
    "tail",
    "follow a collection or a shard: print every new update (ts, diff, key and value "
    "columns) as it arrives, until Ctrl-C",
    _tail_args,
)
def _cmd_tail(client: PersistClient, ns: argparse.Namespace) -> Any:
    out = sys.stdout
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        with open_target(client, ns.target, "persist tail") as t:
            _tail(client, t, ns, out, stop)
    finally:
        _restore_handlers(previous)
    return None


def _tail(client: PersistClient, t: Target, ns: argparse.Namespace, out: IO[str], stop: threading.Event) -> None:
    names = t.schemas.key_names + t.schemas.val_names
    printer = RowPrinter(
        ["ts", "diff"] + names, out, as_json=ns.json, formatters={"diff": _diff_text, "ts": _ts_text}
    )
    as_of = ns.from_
    snapshot = ns.snapshot
    if as_of is None:
        as_of = _latest(t)
        while as_of is None:
            # Nothing written yet: wait for the first write; all of it is new, so print
            # the contents at the first complete time, then follow.
            snapshot = True
            if stop.wait(0.2):
                return
            as_of = _latest(t)
    _check_readable(t, as_of)
    if not ns.json:
        what = "the contents at, then every update after" if snapshot else "every update after"
        _say(f"{t.label}: {what} {time_text(as_of)}{t.note(as_of)} (Ctrl-C to stop)")
    if snapshot:
        with t.reader.snapshot_batches(as_of, timeout_s=10.0) as stream:
            for batch in stream:
                printer.print_table(batch)
                out.flush()
    listen = t.reader.listen(as_of)
    try:
        frontier = Antichain([as_of + 1])
        while not stop.is_set():
            for e in listen.next(timeout_s=0.25):
                if isinstance(e, ListenUpdates) and e.table.num_rows:
                    printer.print_table(e.table)
                elif isinstance(e, ListenProgress):
                    frontier = e.upper
            out.flush()
            client.heartbeat_due()  # a long tail keeps its lease
            if frontier.is_empty():
                if not ns.json:
                    _say(f"{t.label}: its upper is closed: no more updates")
                return
            if ns.until is not None and not frontier.less_equal(ns.until):
                if not ns.json:
                    _say(f"{printer.rows:,} update(s); every update up to {time_text(ns.until)} printed")
                return
        if not ns.json:
            _say(f"stopped at {frontier_text(frontier.elements)}; {printer.rows:,} update(s) printed, reader released")
    finally:
        close = getattr(listen, "close", None)
        if close is not None:
            close()


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    """Ctrl-C / SIGTERM set ``stop`` (the loop ends and releases its reader); a second
    Ctrl-C interrupts at once. Only in the main thread (signals can't be set elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_handlers(previous: dict[int, Any]) -> None:
    for sig, h in previous.items():
        signal.signal(sig, h)

