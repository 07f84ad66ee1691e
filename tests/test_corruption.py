"""Corruption is always detected, never returned as data (R8).

Random bit flips and truncations of parts, of the latest rollup and of the consensus
entries a cold open replays must make a read raise ``CorruptionError``. The property
runs ``CORRUPTION_EXAMPLES`` examples (default 300; the long tier runs >= 10^4) over
read-side corruption of a ``mem://`` fixture, plus a handful of real on-disk
corruptions of file blobs and SQLite rows.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.errors import CorruptionError
from persist_lib.shard.machine import clear_state_cache
from persist_lib.testing.corruption import KEY, VAL, CorruptionFixture, flip_bit, truncate_to

EXAMPLES = int(os.environ.get("CORRUPTION_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def fixture() -> CorruptionFixture:
    return CorruptionFixture()


def mutations() -> st.SearchStrategy:
    return st.one_of(
        st.integers(0, 1 << 40).map(lambda p: ("flip", p)),
        st.floats(0.0, 0.999).map(lambda f: ("truncate", f)),
    )


def _mutation(m: tuple[str, float]):  # type: ignore[no-untyped-def]
    return flip_bit(int(m[1])) if m[0] == "flip" else truncate_to(float(m[1]))


def test_fixture_covers_every_kind(fixture: CorruptionFixture) -> None:
    kinds = {t.kind for t in fixture.targets}
    assert kinds == {"part", "rollup", "consensus"}, kinds
    assert fixture.n_inline > 0  # inline parts live in state: covered by consensus/rollup targets


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=mutations())
def test_corruption_is_detected(fixture: CorruptionFixture, data: st.DataObject, m: tuple[str, float]) -> None:
    target = data.draw(st.sampled_from(fixture.targets))
    outcome = fixture.read_corrupted(target, _mutation(m))
    assert outcome in ("detected", "unchanged"), f"{target} {m}: {outcome}"


# ----- real bytes on disk -------------------------------------------------------------------


def _disk_shard(tmp_path: Path) -> tuple[str, str, str, int]:
    blob_uri = "file://" + quote(str(tmp_path / "blob"))
    cons_uri = "sqlite:///" + quote(str(tmp_path / "c.db"))
    shard = str(ShardId.new())
    c = PersistClient.open(blob_uri, cons_uri, PersistConfig.for_tests(inline_threshold=0, rollup_interval=3))
    w, _ = c.open(shard, KEY, VAL)
    for t in range(5):
        w.compare_and_append([(((f"k{t}",), (t,)), t, 1)], t, t + 1)
    c.close()
    clear_state_cache()
    return blob_uri, cons_uri, shard, 4


def _cold_snapshot(blob_uri: str, cons_uri: str, shard: str, as_of: int) -> object:
    clear_state_cache()
    c = PersistClient.open(blob_uri, cons_uri, PersistConfig.for_tests(retry_deadline_s=0.5))
    try:
        return c.open_leased_reader(shard, KEY, VAL).snapshot(as_of)
    finally:
        c.close()
        clear_state_cache()


@pytest.mark.parametrize("what", ["part_flip", "part_truncate", "rollup_flip", "consensus_flip", "consensus_truncate"])
def test_on_disk_corruption_is_detected(tmp_path: Path, what: str) -> None:
    blob_uri, cons_uri, shard, as_of = _disk_shard(tmp_path)
    blob_root = tmp_path / "blob" / shard
    files = sorted(p for p in blob_root.rglob("*") if p.is_file() and not p.name.startswith("."))
    if what.startswith("part") or what.startswith("rollup"):
        kind = "rollup" if what.startswith("rollup") else "part"
        victims = [p for p in files if (p.parent.name == "rollup") == (kind == "rollup")]
        assert victims
        victim = victims[-1] if kind == "rollup" else victims[0]
        b = victim.read_bytes()
        victim.write_bytes(b[: len(b) // 2] if what.endswith("truncate") else b[:10] + bytes([b[10] ^ 0x10]) + b[11:])
    else:
        db = sqlite3.connect(tmp_path / "c.db")
        seqno, data = db.execute("SELECT seqno, data FROM consensus WHERE shard=? ORDER BY seqno DESC LIMIT 1", (shard,)).fetchone()
        data = bytes(data)
        bad = data[: len(data) // 2] if what.endswith("truncate") else data[:40] + bytes([data[40] ^ 1]) + data[41:]
        db.execute("UPDATE consensus SET data=? WHERE shard=? AND seqno=?", (bad, shard, seqno))
        db.commit()
        db.close()
    with pytest.raises(CorruptionError):
        _cold_snapshot(blob_uri, cons_uri, shard, as_of)
