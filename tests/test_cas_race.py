"""Compare-and-set under a real race: 4 OS processes, one key, plus a truncater.

Each worker repeatedly reads the head and tries to CAS ``head + 1`` with bytes that
name the worker and attempt, recording every CAS it won. A truncater keeps deleting
old entries (after scanning them, so the full history is known). The checker then
demands: no seqno has two winners, no ``expected`` has two winners (a fork, i.e. a
lost update), the chain is gapless, every stored entry is exactly its winner's bytes,
and no process ever saw the head go backwards.

The negative control runs the same race and checker against a deliberately broken
Postgres CAS (``EXISTS(= expected) AND NOT EXISTS(> expected)`` with seqno steps of
1-3, under READ COMMITTED; research/reliability.md section 5), which forks; the test
asserts that the checker catches it, proving the checker can fail.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from persist_lib.errors import Determinate, Indeterminate
from persist_lib.location import CaSResult, VersionedData, open_consensus

KEY = "race-shard"
WORKERS = 4
ATTEMPTS = 150  # per worker; keep the default run short (shared 2-core machine)
FIRST_WRITE_KEYS = 20


@dataclass
class Claim:
    worker: int
    expected: int
    new: int
    data: bytes


@dataclass
class History:
    claims: list[Claim] = field(default_factory=list)
    maybe: list[Claim] = field(default_factory=list)  # indeterminate outcomes
    stored: dict[int, bytes] = field(default_factory=dict)  # every entry ever observed
    observation_conflicts: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    initial: int = 0
    first_wins: list[tuple[str, int]] = field(default_factory=list)  # (key, worker)


def check_history(h: History, *, contiguous: bool = True) -> list[str]:
    """Every violation of linearizable CAS found in ``h`` (empty list: none)."""
    v: list[str] = list(h.observation_conflicts) + list(h.regressions)
    by_new = Counter(c.new for c in h.claims)
    v += [f"seqno {s} has {n} winners" for s, n in sorted(by_new.items()) if n > 1]
    by_expected = Counter(c.expected for c in h.claims)
    v += [
        f"fork: {n} CAS with expected={e} all committed (lost update)"
        for e, n in sorted(by_expected.items())
        if n > 1
    ]
    for c in h.claims:
        if c.new not in h.stored:
            v.append(f"won seqno {c.new} (worker {c.worker}) is not in the log")
        elif h.stored[c.new] != c.data:
            v.append(
                f"seqno {c.new}: stored {h.stored[c.new]!r} but worker {c.worker} won it with "
                f"{c.data!r}"
            )
        elif contiguous and c.new != c.expected + 1:
            v.append(f"claim {c} is not expected + 1")
    seqnos = sorted(h.stored)
    if contiguous and seqnos and seqnos != list(range(seqnos[0], seqnos[-1] + 1)):
        missing = sorted(set(range(seqnos[0], seqnos[-1] + 1)) - set(seqnos))
        v.append(f"gaps in the log: missing {missing[:10]}")
    claimed = {c.new for c in h.claims} | {c.new for c in h.maybe}
    unclaimed = [s for s in seqnos if s != h.initial and s not in claimed]
    if unclaimed:
        v.append(f"entries nobody wrote: {unclaimed[:10]}")
    # linkage: a claim's expected must be the entry right before it in the log
    pred = dict(zip(seqnos[1:], seqnos[:-1], strict=False))
    for c in h.claims:
        if c.new in pred and pred[c.new] != c.expected and h.stored.get(c.new) == c.data:
            v.append(f"seqno {c.new} was appended after {c.expected} but follows {pred[c.new]}")
    return v


# -- a deliberately broken CAS (negative control; never use this) ---------------------


class BrokenPgCas:
    """``NOT EXISTS (seqno > expected)`` + random steps: forks under READ COMMITTED."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS broken_consensus (shard text, seqno bigint, data bytea, "
            "PRIMARY KEY (shard, seqno))"
        )

    def head(self, key: str) -> VersionedData | None:
        row = self.conn.execute(
            "SELECT seqno, data FROM broken_consensus WHERE shard = %s ORDER BY seqno DESC LIMIT 1",
            (key,),
        ).fetchone()
        return None if row is None else VersionedData(row[0], bytes(row[1]))

    def compare_and_set(self, key: str, expected: int | None, new: VersionedData) -> CaSResult:
        if expected is None:
            cur = self.conn.execute(
                "INSERT INTO broken_consensus (shard, seqno, data) SELECT %s, %s, %s "
                "WHERE NOT EXISTS (SELECT 1 FROM broken_consensus WHERE shard = %s)",
                (key, new.seqno, new.data, key),
            )
            return CaSResult.COMMITTED if cur.rowcount == 1 else CaSResult.EXPECTATION_MISMATCH
        try:
            cur = self.conn.execute(
                "INSERT INTO broken_consensus (shard, seqno, data) SELECT %s, %s, %s "
                "WHERE EXISTS (SELECT 1 FROM broken_consensus WHERE shard = %s AND seqno = %s) "
                "AND NOT EXISTS (SELECT 1 FROM broken_consensus WHERE shard = %s AND seqno > %s)",
                (key, new.seqno, new.data, key, expected, key, expected),
            )
        except psycopg.errors.UniqueViolation:
            return CaSResult.EXPECTATION_MISMATCH
        return CaSResult.COMMITTED if cur.rowcount == 1 else CaSResult.EXPECTATION_MISMATCH

    def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        rows = self.conn.execute(
            "SELECT seqno, data FROM broken_consensus WHERE shard = %s AND seqno >= %s "
            "ORDER BY seqno LIMIT %s",
            (key, from_seqno, limit),
        ).fetchall()
        return [VersionedData(s, bytes(d)) for s, d in rows]

    def close(self) -> None:
        self.conn.close()


def _open(kind: str, uri: str) -> Any:
    return BrokenPgCas(uri) if kind == "broken" else open_consensus(uri)


# -- processes (module level: spawned children import this module) -------------------


def race_worker(kind: str, uri: str, wid: int, attempts: int, start: Any, out: Any) -> None:
    rng = random.Random(wid)
    c = _open(kind, uri)
    wins: list[tuple[int, int, bytes]] = []
    maybe: list[tuple[int, int, bytes]] = []
    regressions: list[str] = []
    last = -1
    first_wins: list[str] = []
    start.wait()
    if kind != "broken":
        # racing first writes (expected=None) with different seqnos: one winner per key
        for r in range(FIRST_WRITE_KEYS):
            new0 = VersionedData(rng.randint(0, 5), f"w{wid}".encode())
            try:
                if c.compare_and_set(f"first-{r}", None, new0) == CaSResult.COMMITTED:
                    first_wins.append(f"first-{r}")
            except (Determinate, Indeterminate):
                pass
    for i in range(attempts):
        h = c.head(KEY)
        assert h is not None
        if h.seqno < last:
            regressions.append(f"worker {wid} saw the head go from {last} to {h.seqno}")
        last = h.seqno
        time.sleep(rng.random() * 0.0005)  # widen the read-then-CAS window a little
        step = rng.randint(1, 3) if kind == "broken" else 1
        new = VersionedData(h.seqno + step, f"w{wid}-a{i}-s{h.seqno + step}".encode())
        try:
            r = c.compare_and_set(KEY, h.seqno, new)
        except Determinate:
            continue
        except Indeterminate:
            maybe.append((h.seqno, new.seqno, new.data))
            continue
        if r == CaSResult.COMMITTED:
            wins.append((h.seqno, new.seqno, new.data))
            last = max(last, new.seqno)
    c.close()
    out.put(("worker", wid, wins, maybe, regressions, first_wins))


def truncater(uri: str, stop: Any, out: Any) -> None:
    """Scans, records and truncates old entries until told to stop."""
    c = open_consensus(uri)
    observed: dict[int, bytes] = {}
    conflicts: list[str] = []
    truncations = 0
    while not stop.is_set():
        h = c.head(KEY)
        for e in c.scan(KEY, 0, 100_000):
            if observed.setdefault(e.seqno, e.data) != e.data:
                conflicts.append(
                    f"seqno {e.seqno} changed from {observed[e.seqno]!r} to {e.data!r}"
                )
        if h is not None and h.seqno >= 3:
            if c.truncate(KEY, h.seqno - 2) > 0:
                truncations += 1
        time.sleep(0.003)
    c.close()
    out.put(("truncater", observed, conflicts, truncations))


def run_race(kind: str, uri: str, *, attempts: int = ATTEMPTS, truncate: bool = True) -> History:
    ctx = multiprocessing.get_context("spawn")
    init = _open(kind, uri)
    assert init.compare_and_set(KEY, None, VersionedData(0, b"init")) == CaSResult.COMMITTED
    out = ctx.Queue()
    start = ctx.Barrier(WORKERS)
    stop = ctx.Event()
    procs = [
        ctx.Process(target=race_worker, args=(kind, uri, w, attempts, start, out), daemon=True)
        for w in range(WORKERS)
    ]
    trunc = ctx.Process(target=truncater, args=(uri, stop, out), daemon=True)
    if truncate:
        trunc.start()
    for p in procs:
        p.start()
    h = History()
    try:
        for _ in range(WORKERS):
            msg = out.get(timeout=120)
            _, wid, wins, maybe, regressions, first_wins = msg
            h.first_wins += [(k, wid) for k in first_wins]
            h.claims += [Claim(wid, e, n, d) for e, n, d in wins]
            h.maybe += [Claim(wid, e, n, d) for e, n, d in maybe]
            h.regressions += regressions
        if truncate:
            stop.set()
            _, observed, conflicts, truncations = out.get(timeout=60)
            assert truncations > 0, "the truncater never truncated: the race did not overlap"
            h.stored.update(observed)
            h.observation_conflicts += conflicts
    except queue.Empty:
        pytest.fail(f"a race process did not report: exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in [*procs, trunc]:
            if p.pid is not None:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    for e in init.scan(KEY, 0, 100_000):
        if h.stored.setdefault(e.seqno, e.data) != e.data:
            h.observation_conflicts.append(f"seqno {e.seqno} changed at the end")
    init.close()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return h


# -- tests ----------------------------------------------------------------------------


def test_checker_flags_synthetic_violations() -> None:
    ok = History(
        claims=[Claim(0, 0, 1, b"a"), Claim(1, 1, 2, b"b")],
        stored={0: b"init", 1: b"a", 2: b"b"},
    )
    assert check_history(ok) == []
    forked = History(
        claims=[Claim(0, 0, 1, b"a"), Claim(1, 0, 2, b"b")],
        stored={0: b"init", 1: b"a", 2: b"b"},
    )
    assert any("fork" in x for x in check_history(forked, contiguous=False))
    lost = History(claims=[Claim(0, 0, 1, b"a"), Claim(1, 0, 1, b"b")], stored={0: b"", 1: b"b"})
    problems = check_history(lost)
    assert any("2 winners" in x for x in problems) and any("stored" in x for x in problems)
    gap = History(
        claims=[Claim(0, 0, 1, b"a"), Claim(0, 2, 3, b"c")], stored={0: b"", 1: b"a", 3: b"c"}
    )
    assert any("gaps" in x for x in check_history(gap))


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_cas_race_is_linearizable(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "sqlite":
        uri = "sqlite:///" + quote(str(tmp_path / "race.db"))
    else:
        uri = request.getfixturevalue("pg_consensus_url")
    h = run_race("real", uri)
    assert check_history(h) == []
    # exactly one first write won each key, and the log holds the winner's bytes
    assert sorted(k for k, _ in h.first_wins) == sorted(
        f"first-{r}" for r in range(FIRST_WRITE_KEYS)
    )
    c = open_consensus(uri)
    for k, wid in h.first_wins:
        head = c.head(k)
        assert head is not None and head.data == f"w{wid}".encode()
        assert len(c.scan(k, 0, 100)) == 1
    c.close()
    assert len(h.claims) >= 50, f"too few wins to mean anything: {len(h.claims)}"
    # An indeterminate CAS committed iff the log holds its (unique) bytes at its seqno:
    # with those resolved, the log's head counts every win exactly.
    maybe_won = [m for m in h.maybe if h.stored.get(m.new) == m.data]
    assert max(h.stored) == len(h.claims) + len(maybe_won), (max(h.stored), len(h.claims), h.maybe)
    won_by = Counter(c.worker for c in h.claims)
    assert len(won_by) >= 2, f"no real race: only workers {dict(won_by)} won"
    assert len(h.claims) < WORKERS * ATTEMPTS, "no CAS ever lost: the workers did not race"


@pytest.mark.postgres
def test_checker_catches_the_forking_postgres_cas(pg_consensus_url: str) -> None:
    """Negative control: the NOT EXISTS CAS with non-contiguous seqnos forks."""
    problems: list[str] = []
    for _ in range(3):  # forks are very likely in one round; allow a few tries
        h = run_race("broken", pg_consensus_url, attempts=120, truncate=False)
        problems = check_history(h, contiguous=False)
        if problems:
            break
        with psycopg.connect(pg_consensus_url, autocommit=True) as conn:
            conn.execute("DELETE FROM broken_consensus")
    assert any("fork" in p for p in problems), "the broken CAS did not fork: checker too weak?"
