"""The outputs of a binding commit as ONE transaction (issue 27): an ingestion killed
with ``kill -9`` between its outputs (before the commit CAS, right after it, between
the applies to the data and errors shards, between the metadata advances) leaves every
shard of both collections at one upper, a reader never seeing a binding's data without
its errors, and after a restart each appears exactly once."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pyarrow as pa

from persist_lib import PersistClient, PersistConfig
from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
from persist_lib.ingest.outputs import StorageOutputs
from persist_lib.storage import StorageController
from tests.support.kill_at_op import run_until_stopped

KEY = pa.schema([("id", pa.int64())])
VAL = pa.schema([("name", pa.string())])
GOOD, BAD = 30, 6

CHILD = """
    import os
    import pyarrow as pa
    from persist_lib import PersistClient, PersistConfig
    from persist_lib.ingest import IngestConfig, Ingestion, LandingZoneSource
    from persist_lib.ingest.outputs import StorageOutputs
    from persist_lib.storage import StorageController
    client = PersistClient.open(blob, cons, PersistConfig.for_tests(compaction_enabled=False))
    ctl = StorageController(client)
    K = pa.schema([("id", pa.int64())]); V = pa.schema([("name", pa.string())])
    ing = Ingestion(client, "orders", LandingZoneSource(os.environ["ZONE"]), K, V, clock=lambda: 1,
                    outputs=StorageOutputs(ctl, "orders", num_shards=2),
                    config=IngestConfig(max_records_per_binding=1000))
    ing._open()
    counting[0] = True
    ing.run_once()
    print("done", ops[0], flush=True)
    """


def _zone(path: Path) -> Path:
    path.mkdir(parents=True)
    lines = [f'{{"id": {i}, "name": "n{i}"}}' for i in range(GOOD)]
    lines += ['{"id": "not a number", "name": "x"}'] * BAD
    (path / "a.jsonl").write_text("\n".join(lines) + "\n")
    return path


def _location(tmp: Path) -> tuple[str, str]:
    (tmp / "blob").mkdir(parents=True)
    return f"file://{tmp / 'blob'}", f"sqlite:///{tmp / 'c.db'}"


def _contents(ctl: StorageController, name: str) -> Counter:
    """The collection's contents at its latest readable time (empty if none)."""
    r = ctl.acquire_read_handle(name)
    try:
        d = ctl.describe(name)
        upper = min(d["metadata_upper"][0], d["renditions"][d["active_rendition"]]["upper"][0])
        if upper == 0:
            return Counter()
        got: Counter = Counter()
        for row in r.snapshot(upper - 1).to_pylist():
            got[tuple(sorted((k, str(v)) for k, v in row.items() if k not in ("ts", "diff")))] += row["diff"]
        return +got
    finally:
        r.expire()


def _shards_upper(ctl: StorageController, name: str) -> int:
    d = ctl.describe(name)
    return int(d["renditions"][d["active_rendition"]]["upper"][0])


def _commits(lines: list[str]) -> list[int]:
    """The ops after which the child's commit CASes on the txn log landed."""
    return [int(x.split()[2]) for x in lines if x.startswith("logcas commit") and int(x.split()[2]) > 0]


def _ingest(blob: str, cons: str, zone: Path) -> StorageController:
    client = PersistClient.open(blob, cons, PersistConfig.for_tests(compaction_enabled=False))
    ctl = StorageController(client)
    with Ingestion(client, "orders", LandingZoneSource(str(zone)), KEY, VAL, clock=lambda: 1,
                   outputs=StorageOutputs(ctl, "orders", num_shards=2),
                   config=IngestConfig(max_records_per_binding=1000)) as ing:
        ing.run_once()
    return ctl


def test_killed_between_the_outputs_of_a_binding(tmp_path: Path) -> None:
    zone = _zone(tmp_path / "zone")
    os.environ["ZONE"] = str(zone)
    ref = _ingest(*_location(tmp_path / "ref"), zone)
    want_data, want_errors = _contents(ref, "orders"), _contents(ref, "orders.errors")
    assert sum(want_data.values()) == GOOD and sum(want_errors.values()) == BAD
    cal = run_until_stopped(CHILD, *_location(tmp_path / "cal"), 10**9)
    total = int(cal[-1].split()[1])
    commit = _commits(cal)[0]  # the flush's commit CAS (registrations came before counting)
    # Before the commit CAS, on it, after the first apply (data or errors shard landed,
    # not both), and just before the end.
    for stop in sorted({commit - 1, commit, commit + 1, total - 1}):
        loc = _location(tmp_path / f"k{stop}")
        lines = run_until_stopped(CHILD, *loc, stop)
        assert lines[-1] == "stopped", lines[-3:]
        committed = stop >= commit  # (op `commit` is the CAS itself: stopped right after it)
        ctl = StorageController(PersistClient.open(*loc, PersistConfig.for_tests(compaction_enabled=False)))
        data, errors = _contents(ctl, "orders"), _contents(ctl, "orders.errors")
        # A reader sees all of the binding or none of it in each collection, and never its
        # data without its errors (the errors' metadata upper advances first).
        assert data in (want_data, Counter()) and errors in (want_errors, Counter()), (stop, data, errors)
        assert not data or errors == want_errors, f"data without its errors after a kill at op {stop}"
        # Every shard of both collections advanced together (describe applies what
        # committed), past the binding's time iff the commit CAS landed. (The collection
        # readers above read up to the metadata upper, which the dead child may not have
        # advanced yet: the restart below does.)
        uppers = {_shards_upper(ctl, n) for n in ("orders", "orders.errors")}
        assert len(uppers) == 1, (stop, uppers)
        assert (uppers.pop() > 1) == committed, (stop, committed)
        ctl.close()
        # After a restart, each exactly once.
        ctl = _ingest(*loc, zone)
        assert _contents(ctl, "orders") == want_data and _contents(ctl, "orders.errors") == want_errors, stop
        ctl.close()
