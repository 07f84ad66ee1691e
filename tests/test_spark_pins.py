"""``read_snapshot``'s default on a ``file://`` blob pins the parts it reads (hard links,
``spark.pins``) and returns a lazy DataFrame with the reader's hold already released:
the rows stay exact after garbage collection deletes the parts, and an action after the
pin is removed fails (``PinExpired``) instead of returning other rows."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from persist_lib.shard.batch_meta import PartMeta
from tests.test_spark_direct_read import SHARD, _rows, _shard
from tests.test_spark_key_range_splits import _plan
from tests.test_spark_support import file_location

pytest_plugins = ["tests.spark_fixtures"]


def _parts(client: Any) -> list[PartMeta]:
    return [p for _, b in client.machine(SHARD).fetch_latest().trace_batches() for p in b.parts]


def _delete_parts(client: Any) -> None:
    """What garbage collection does to the parts once no hold keeps them."""
    for p in _parts(client):
        client.blob.delete(p.key)


@pytest.mark.spark
@pytest.mark.parametrize("ties", [False, True], ids=["direct", "history"])
def test_default_read_is_lazy_and_exact_after_the_parts_are_deleted(spark: Any, tmp_path: Path, ties: bool) -> None:
    from persist_lib.spark import read_snapshot

    client, r = _shard(file_location(tmp_path), 31, ties=ties)
    want = _rows(r.snapshot(11))
    df = read_snapshot(spark, r, 11)
    assert r._held_seqnos() == {}  # the hold is released before returning ...
    assert "ExistingRDD" not in _plan(df)  # ... and nothing was materialized (no localCheckpoint)
    if not ties:
        files = df.inputFiles()
        assert files and all("/.spark-pins/" in f for f in files)  # Spark reads the pinned names
    _delete_parts(client)
    assert not any(client.blob.get(str(p.key)) for p in _parts(client))
    assert _rows(df) == want  # computed now, from the pinned files
    assert _rows(df) == want  # and again: every action reads the same bytes
    r.expire()
    client.close()


@pytest.mark.spark
def test_an_action_after_the_pin_is_released_fails_typed(spark: Any, tmp_path: Path) -> None:
    from persist_lib.spark import read_snapshot
    from persist_lib.spark.pins import release_pins

    client, r = _shard(file_location(tmp_path), 32, ties=True)
    df = read_snapshot(spark, r, 11)
    assert release_pins() >= 1
    with pytest.raises(Exception, match="PinExpired"):
        df.collect()
    r.expire()
    client.close()


def test_pins_link_every_blob_part_and_old_pins_are_swept(tmp_path: Path) -> None:
    from persist_lib.spark.direct_read import local_root
    from persist_lib.spark.pins import PIN_DIR, pin_parts, sweep

    client, r = _shard(file_location(tmp_path), 33)
    root = local_root(client.blob_uri)
    assert root is not None
    parts = _parts(client)
    pin = pin_parts(root, parts)
    assert pin is not None and pin.root.startswith(os.path.join(root, PIN_DIR))
    for p in parts:
        assert pin.blob().get(str(p.key)) == client.blob.get(str(p.key))
    assert [m.key for m in client.blob.list_keys_and_metadata("")] == sorted(  # pins are no keys
        m.key for m in client.blob.list_keys_and_metadata("") if PIN_DIR not in m.key
    )
    assert sweep(root) == 0  # young: kept
    old = os.path.join(root, PIN_DIR, f"{int(time.time()) - 7200}-1-x")
    os.makedirs(old)
    assert sweep(root, ttl_s=3600) == 1 and not os.path.exists(old) and os.path.isdir(pin.root)
    # A part that can't be linked (here: already gone): no pin, nothing left behind.
    client.blob.delete(str(parts[-1].key))
    before = sorted(os.listdir(os.path.join(root, PIN_DIR)))
    assert pin_parts(root, parts) is None
    assert sorted(os.listdir(os.path.join(root, PIN_DIR))) == before
    pin.release()
    assert not os.path.exists(pin.root)
    r.expire()
    client.close()


def test_a_forked_child_leaves_the_parents_pins(tmp_path: Path) -> None:
    """A child forked after a read inherits the list of pins and the ``atexit`` hook that
    releases them; when it exits it must not remove the parent's pins (the parent's lazy
    DataFrames still read through them)."""
    from persist_lib.spark.direct_read import local_root
    from persist_lib.spark.pins import pin_parts, release_pins

    release_pins()  # pins an earlier test of this worker process left (counted below otherwise)
    client, r = _shard(file_location(tmp_path), 34)
    root = local_root(client.blob_uri)
    assert root is not None
    pin = pin_parts(root, _parts(client))
    assert pin is not None
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        os._exit(release_pins())  # what its atexit hook runs
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child removed none ...
    assert os.path.isdir(pin.root)  # ... and the parent's pin is still there
    assert release_pins() == 1 and not os.path.exists(pin.root)
    r.expire()
    client.close()


@pytest.mark.parametrize("raw", ["soon", "-5", "0", "nan", "inf"])
def test_a_bad_pin_ttl_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from persist_lib.errors import InvalidUsage
    from persist_lib.spark.pins import pin_ttl_s

    monkeypatch.setenv("PERSIST_SPARK_PIN_TTL_S", raw)
    with pytest.raises(InvalidUsage, match="PERSIST_SPARK_PIN_TTL_S"):
        pin_ttl_s()
    monkeypatch.setenv("PERSIST_SPARK_PIN_TTL_S", "90")
    assert pin_ttl_s() == 90.0
