"""Security at the client/handle layer (R11). The location layer has its own tests
(``tests/test_location_security.py``: hostile blob keys, symlinks, URI redaction, SQL
lint); these cover what sits on top:

1. **Credentials**: a canary password (in the Postgres URL and as an S3 secret key in
   the blob URI) never appears in the repr/str of clients, handles, listens, splits,
   inspect output, in any error message (with its whole chain and traceback) across
   failure paths, or in captured logs at DEBUG.
2. **Hostile shard ids** are rejected by every client entry point before any I/O.
3. **Blob keys from state never escape**: a crafted consensus entry that references a
   part, a rollup or garbage at ``../secret`` (or an absolute path) is never read or
   deleted outside the blob root, whatever the checksums say.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import traceback
import uuid
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pytest

from persist_lib import PersistClient, PersistConfig, ShardId
from persist_lib import state as st
from persist_lib.batch_meta import PartMeta
from persist_lib.errors import InvalidUsage, PersistError
from persist_lib.location.base import CaSResult, VersionedData
from persist_lib.location.sqlite_consensus import SqliteConsensus
from persist_lib.machine import clear_state_cache, frame, unframe

CANARY = "canary-S3cr3t-pw"
KEY = pa.schema([("k", pa.string())])
VAL = pa.schema([("v", pa.int64())])


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _text(e: BaseException) -> str:
    """Everything an exception can show: message, repr, args, chain, traceback."""
    return "".join(traceback.format_exception(e)) + repr(e) + repr(e.args) + str(e)


def _assert_clean(texts: list[str]) -> None:
    for t in texts:
        assert CANARY not in t, t[:2000]


# ----- 1. credentials --------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.s3
def test_canary_never_shows_in_client_objects(
    pg_url: str, s3_server: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert CANARY in pg_url
    endpoint = s3_server.endpoint  # type: ignore[attr-defined]
    bucket = s3_server.create_bucket()  # type: ignore[attr-defined]
    blob_uri = (
        f"s3://{bucket}/p?endpoint_url={endpoint}&region=us-east-1"
        f"&access_key_id=testing&secret_access_key={CANARY}"
    )
    c = PersistClient.open(blob_uri, pg_url, PersistConfig.for_tests(inline_threshold=0))
    shard = ShardId.new()
    w, r = c.open(shard, KEY, VAL)
    w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    since = c.open_critical_since(shard, KEY, VAL)
    lst = r.listen(0)
    splits = r.snapshot_splits(0, 2) + r.range_splits(0, 1, 2)
    m = c.machine(shard)
    texts = [
        repr(c), str(c), repr(w), str(w), repr(r), str(r), repr(since), str(since), repr(lst),
        repr(c.blob), str(c.blob), c.blob.describe(), repr(c.consensus), c.consensus.describe(),
        repr(c.raw_blob), repr(c.raw_consensus), repr(m), repr(c.config),
        repr(splits), str(splits), str(c.inspect(shard)), repr(r.snapshot(0)),
    ]
    r.release_splits()
    c.close()
    texts.append(caplog.text)
    texts += [r_.getMessage() + repr(r_.args) for r_ in caplog.records]
    _assert_clean(texts)


@pytest.mark.postgres
def test_canary_never_leaks_on_client_failure_paths(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    blob_uri = "file://" + quote(str(tmp_path / "blob"))
    down = f"postgresql://persist:{CANARY}@127.0.0.1:{_closed_port()}/db"
    wrong = pg_url.replace(CANARY, CANARY + "-wrong")
    texts: list[str] = []
    for uri in (down, wrong):
        c = PersistClient.open(blob_uri, uri, PersistConfig.for_tests(retry_deadline_s=0.2))
        texts += [repr(c), str(c)]
        for op in (
            lambda c=c: c.open(ShardId.new(), KEY, VAL),
            lambda c=c: c.open_writer(ShardId.new(), KEY, VAL),
            lambda c=c: c.inspect(ShardId.new()),
            lambda c=c: c.expire_leases(),
            lambda c=c: c.list_shards(),
        ):
            with pytest.raises(PersistError) as ei:
                op()
            texts.append(_text(ei.value))
        c.close()
    # A live client whose consensus goes away mid-flight (handles already open).
    c = PersistClient.open(blob_uri, pg_url, PersistConfig.for_tests(retry_deadline_s=0.2))
    w, r = c.open(ShardId.new(), KEY, VAL)
    c.consensus.inner.url = type(c.consensus.inner.url)(wrong)  # type: ignore[attr-defined]
    c.consensus.inner._drop_conn()  # type: ignore[attr-defined]
    for op in (
        lambda: w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1),
        lambda: w.heartbeat(),
        lambda: r.downgrade_since(0),
        lambda: w.fetch_recent_upper(),
    ):
        with pytest.raises(PersistError) as ei:
            op()
        texts.append(_text(ei.value))
    c.close()
    texts.append(caplog.text)
    texts += [r_.getMessage() + repr(r_.args) for r_ in caplog.records]
    _assert_clean(texts)
    _assert_clean([t.replace(CANARY + "-wrong", "") for t in texts])


@pytest.mark.s3
def test_canary_never_leaks_from_blob_failures(s3_server: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    endpoint = s3_server.endpoint  # type: ignore[attr-defined]
    blob_uri = (
        f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p?endpoint_url={endpoint}&region=us-east-1"
        f"&access_key_id=testing&secret_access_key={CANARY}"
    )
    c = PersistClient.open(
        blob_uri, f"mem://{uuid.uuid4().hex}", PersistConfig.for_tests(inline_threshold=0, retry_deadline_s=0.2)
    )
    w, r = c.open(ShardId.new(), KEY, VAL)
    texts = [repr(c)]
    with pytest.raises(PersistError) as ei:
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)  # the part upload fails
    texts.append(_text(ei.value))
    c.close()
    texts.append(caplog.text)
    _assert_clean(texts)


# ----- 2. hostile shard ids --------------------------------------------------------------------

HOSTILE_SHARDS = [
    "",
    "..",
    "../x",
    "/etc/passwd",
    "s../../x",
    f"{ShardId.new()}/../x",
    f"../{ShardId.new()}",
    f"{ShardId.new()}\x00",
    f"{ShardId.new()}\n",
    f" {ShardId.new()}",
    str(ShardId.new()).upper(),
    "s" + "\uff10" * 8 + str(uuid.uuid4())[8:],  # fullwidth digits
    "s" + "0" * 5000,
    "shard; DROP TABLE consensus; --",
    "s' OR '1'='1",
]


@pytest.mark.parametrize("bad", HOSTILE_SHARDS, ids=range(len(HOSTILE_SHARDS)))
def test_hostile_shard_ids_are_rejected(bad: str, tmp_path: Path) -> None:
    blob_root = tmp_path / "blob"
    c = PersistClient.open("file://" + quote(str(blob_root)), "sqlite:///" + quote(str(tmp_path / "c.db")),
                           PersistConfig.for_tests())
    for op in (
        lambda: c.open(bad, KEY, VAL),
        lambda: c.open_writer(bad, KEY, VAL),
        lambda: c.open_leased_reader(bad, KEY, VAL),
        lambda: c.open_critical_since(bad, KEY, VAL),
        lambda: c.inspect(bad),
        lambda: c.expire_leases(bad),
        lambda: c.compact(bad),
        lambda: c.gc(bad),
        lambda: c.finalize(bad),
        lambda: c.unreferenced_blobs(bad),
        lambda: c.machine(bad),
    ):
        with pytest.raises(InvalidUsage):
            op()
    assert list(c.consensus.list_keys()) == []
    assert not blob_root.exists() or not any(blob_root.rglob("*"))
    c.close()


def test_hostile_critical_reader_id_is_rejected(tmp_path: Path) -> None:
    c = PersistClient.open(f"mem://{uuid.uuid4().hex}", f"mem://{uuid.uuid4().hex}", PersistConfig.for_tests())
    for bad in ("../x", "c", "r" + str(uuid.uuid4()), "c" + str(uuid.uuid4()) + "/.."):
        with pytest.raises(InvalidUsage):
            c.open_critical_since(ShardId.new(), KEY, VAL, reader_id=bad)


# ----- 3. blob keys from state never escape -----------------------------------------------------


class _Jail:
    """A shard on file blob + SQLite, plus a secret file next to the blob root."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "blob"
        self.db = tmp_path / "c.db"
        self.outside = tmp_path / "secret"
        self.payload = b"not yours"
        self.outside.write_bytes(self.payload)
        self.blob_uri = "file://" + quote(str(self.root))
        self.cons_uri = "sqlite:///" + quote(str(self.db))
        self.shard = str(ShardId.new())
        c = self.client(inline_threshold=0, rollup_interval=1000)
        w, _ = c.open(self.shard, KEY, VAL)
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
        c.close()
        clear_state_cache()

    def client(self, **cfg: object) -> PersistClient:
        return PersistClient.open(self.blob_uri, self.cons_uri, PersistConfig.for_tests(retry_deadline_s=0.3, **cfg))

    def forge(self, mutate) -> None:  # type: ignore[no-untyped-def]
        """Appends a consensus entry whose state is ``mutate(current state)``."""
        cons = SqliteConsensus(self.db)
        entries = cons.scan(self.shard, 0, 10_000)
        cur = st.ShardState(self.shard)
        for e in entries:
            cur = st.apply_diff(cur, unframe(e.data, shard=self.shard, what="x"), e.seqno)
        new = replace(mutate(cur), seqno=cur.seqno + 1, walltime_ms=cur.walltime_ms + 1)
        res = cons.compare_and_set(self.shard, cur.seqno, VersionedData(new.seqno, frame(st.encode_diff(cur, new))))
        assert res is CaSResult.COMMITTED
        cons.close()
        clear_state_cache()

    def outside_intact(self) -> bool:
        return self.outside.exists() and self.outside.read_bytes() == self.payload


def _hostile_keys(j: _Jail) -> list[str]:
    return [
        "../secret",
        f"{j.shard}/../../secret",
        str(j.outside),
        "/" + str(j.outside).lstrip("/"),
        f"{j.shard}/w/../../../secret",
    ]


@pytest.mark.parametrize("i", range(5))
def test_part_key_from_state_never_escapes(tmp_path: Path, i: int) -> None:
    j = _Jail(tmp_path)
    key = _hostile_keys(j)[i]
    sha = hashlib.sha256(j.payload).hexdigest()

    def point_part_outside(s: st.ShardState) -> st.ShardState:
        batches = dict(s.batches)
        bid = max(batches)
        b = batches[bid]
        p = PartMeta(key=key, size=len(j.payload), count=1, sha256=sha, tmin=0, tmax=0)
        batches[bid] = replace(b, parts=(p,))
        return replace(s, batches=batches)

    j.forge(point_part_outside)
    c = j.client()
    r = c.open_leased_reader(j.shard, KEY, VAL)
    with pytest.raises(PersistError) as ei:
        r.snapshot(0)
    assert j.payload.decode() not in _text(ei.value)
    c.close()
    assert j.outside_intact()


@pytest.mark.parametrize("i", range(5))
def test_garbage_key_from_state_is_never_deleted_outside(tmp_path: Path, i: int) -> None:
    j = _Jail(tmp_path)
    key = _hostile_keys(j)[i]
    j.forge(lambda s: replace(s, garbage={**s.garbage, key: st.GarbageEntry(1, 9)}))
    c = j.client()
    c.machine(j.shard).write_rollup()  # GC needs a rollup at or after the garbage's seqno
    try:
        c.gc(j.shard)
    except PersistError:
        pass  # refusing is fine; deleting outside the root is not
    c.close()
    assert j.outside_intact()


@pytest.mark.parametrize("i", range(5))
def test_rollup_key_from_state_never_escapes(tmp_path: Path, i: int) -> None:
    j = _Jail(tmp_path)
    key = _hostile_keys(j)[i]
    j.forge(lambda s: replace(s, rollups={**s.rollups, s.seqno: st.RollupRef(key, 9)}))
    j.outside.write_bytes(j.payload)
    clear_state_cache()
    c = j.client()
    try:
        r = c.open_leased_reader(j.shard, KEY, VAL)  # a cold open loads the latest rollup
        r.snapshot(0)
        c.gc(j.shard)  # and GC may delete old rollups
    except PersistError as e:
        assert j.payload.decode() not in _text(e)
    c.close()
    assert j.outside_intact()
