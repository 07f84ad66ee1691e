"""Verified appends where the since has passed the replayed range (issue 26, defect 9).

An instance that replays times another writer committed compares its updates with the
committed ones. Below the since, compaction folds the committed updates into the since:
the range is then checked on its contents at the since when that is decidable (the
range starts at 0), and otherwise the append stops with ``ReplayUnverifiable``. It used
to skip the check, count the range as "unverifiable" and carry on.

Through the driver the case is hard to reach: each instance's own readers hold the
since of its outputs and of the remap shard below where it resumes. These tests drive
the output directly, with a since moved past the range.
"""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib.ingest import NeedsNewRendition, ReplayUnverifiable
from persist_lib.ingest.outputs import ShardOutput

K = pa.schema([("k", pa.int64())])
V = pa.schema([("v", pa.string())])


def _updates(rows: list[tuple[int, str, int]]) -> pa.Table:
    """(key, value, time) rows, each with diff +1, in the user layout."""
    return pa.table({
        "k": pa.array([r[0] for r in rows], pa.int64()),
        "v": pa.array([r[1] for r in rows], pa.string()),
        "ts": pa.array([r[2] for r in rows], pa.int64()),
        "diff": pa.array([1] * len(rows), pa.int64()),
    })


ROWS = [(t, f"v{t}", t) for t in range(10)]  # one key per time in [0, 10)


@pytest.fixture
def pair() -> Any:
    """Two instances' outputs on one shard: ``a`` committed [0, 10) (in two appends),
    and compaction folded the times up to ``b``'s since into it."""
    tag = uuid.uuid4().hex
    client = PersistClient.open(f"mem://b-{tag}", f"mem://c-{tag}", PersistConfig.for_tests())
    shard = ShardId.new()
    a = ShardOutput(client, shard, K, V, role="data", label="a")
    b = ShardOutput(client, shard, K, V, role="data", label="b")

    def setup(b_since: int) -> tuple[ShardOutput, ShardOutput]:
        a.append(_updates(ROWS[:5]), 0, 5)
        a.append(_updates(ROWS[5:]), 5, 10)
        for o in (a, b):
            o.downgrade_since(b_since)
        client.compact(shard)  # the shard since is b_since: times up to it are forwarded
        return a, b

    yield client, shard, setup
    client.close()


def test_a_replay_from_zero_is_checked_on_its_contents_at_the_since(pair: Any) -> None:
    client, shard, setup = pair
    a, b = setup(6)
    b.append(_updates(ROWS + [(10, "v10", 10)]), 0, 11)
    assert (b.stats.verified, b.stats.written) == (1, 1)
    assert b.upper() == 11


def test_a_replay_differing_below_the_since_needs_a_new_rendition(pair: Any) -> None:
    client, shard, setup = pair
    a, b = setup(6)
    rows = list(ROWS)
    rows[2] = (2, "other", 2)  # differs at a time the since has passed
    with pytest.raises(NeedsNewRendition, match=r"\[0, 10\)"):
        b.append(_updates(rows), 0, 10)
    assert b.stats.verified == 0


def test_a_replay_differing_above_the_since_needs_a_new_rendition(pair: Any) -> None:
    client, shard, setup = pair
    a, b = setup(6)
    rows = list(ROWS)
    rows[8] = (8, "other", 8)
    with pytest.raises(NeedsNewRendition):
        b.append(_updates(rows), 0, 10)


def test_a_replay_moved_in_time_below_the_since_is_still_equal_there(pair: Any) -> None:
    """At the since only the contents count: the same updates at other times below it
    fold to the same contents (no reader can tell them apart any more)."""
    client, shard, setup = pair
    a, b = setup(6)
    rows = [(k, v, 0 if t <= 6 else t) for k, v, t in ROWS]
    b.append(_updates(rows), 0, 10)
    assert b.stats.verified == 1


def test_a_replay_from_past_the_start_below_the_since_stops(pair: Any) -> None:
    client, shard, setup = pair
    a, b = setup(7)
    with pytest.raises(ReplayUnverifiable, match=r"\[5, 10\).*since is 7"):
        b.append(_updates(ROWS[5:]), 5, 10)
    assert b.stats.verified == 0 and b.upper() == 10


def test_a_replay_the_since_has_passed_entirely_stops(pair: Any) -> None:
    client, shard, setup = pair
    a, b = setup(9)
    with pytest.raises(ReplayUnverifiable, match=r"\[0, 5\)"):
        b.append(_updates(ROWS[:5]), 0, 5)
