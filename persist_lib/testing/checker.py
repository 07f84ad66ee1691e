"""The history checker: turns a finished history into violations by kind.

Ground truth is the consensus log itself. The audit wrappers archived every entry
before GC truncated it, so the checker replays the *whole* state history from seqno 1
(``replay``) and reads every part that was ever referenced (from blob, or from the
graveyard copy kept when it was deleted). From that:

1. **Consensus**: no two entries at one seqno (a fork), no entry that changed after it
   was archived, no gap, the head never regressed, every entry decodes and follows its
   predecessor.
2. **State versions**: upper and since never regress (shard and each reader), reader
   seqno holds never regress, the trace is contiguous and ends at the upper, a batch's
   since is not beyond the shard since, no part is referenced twice.
3. **Commits**: every version that changed a writer's idempotency token is a committed
   write; it is attributed to the logged operation (writer id + bounds + data) and its
   data must equal what that operation wrote (for definite appends: the deterministic
   stream restricted to the committed interval). Acknowledged writes commit exactly
   once, failed (definite) writes never, indeterminate ones at most once.
4. **Real-time order**: if A completed before B was invoked, ``seqno(A) < seqno(B)``.
5. **Reads**: every ok snapshot equals the model at its ``as_of``; every listen's output,
   at each progress event, equals the model's updates in ``(as_of, upper)``.
6. **Contents**: after every non-append change of the trace (a merge) and at the end,
   the trace's updates, forwarded to the shard since, equal the model's.
7. **GC safety (delete audit)**: a part deleted when the head was ``h`` must not be
   referenced by any version ``>= seqno_since(state h)``; a rollup deleted then must not
   be the latest rollup of any version ``>= h``.
8. **Clients**: no ``CorruptionError``, no ``BlobNotFound`` (the read path turns it into
   ``LeaseExpired`` when the lease lapsed), no unexpected exception, no backward since
   downgrade accepted, no lease expired less than a lease after a heartbeat, no
   divergent verified append (a replay of committed times with other updates) that
   returned normally.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persist_lib.errors import PersistError
from persist_lib.location.base import Consensus
from persist_lib.location.file_blob import FileBlob
from persist_lib.shard import state as st
from persist_lib.shard.batch_meta import PartMeta
from persist_lib.shard.machine import unframe
from persist_lib.testing import model
from persist_lib.testing.history import FAIL, INFO, OK, History, Op, load_events
from persist_lib.testing.history_config import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    HistoryConfig,
    definite_updates,
)

VIOLATION_KINDS: tuple[str, ...] = (
    "consensus_fork",
    "consensus_entry_rewritten",
    "consensus_head_regressed",
    "consensus_gap",
    "state_undecodable",
    "upper_regressed",
    "since_regressed",
    "reader_since_regressed",
    "reader_hold_regressed",
    "trace_not_contiguous",
    "batch_since_beyond_shard_since",
    "part_referenced_twice",
    "part_missing",
    "unattributed_commit",
    "commit_data_mismatch",
    "acked_write_lost",
    "failed_write_committed",
    "duplicate_commit",
    "realtime_order",
    "snapshot_mismatch",
    "listen_mismatch",
    "read_beyond_upper",
    "trace_contents_wrong",
    "reachable_blob_deleted",
    "live_rollup_deleted",
    "corruption_observed",
    "blob_not_found_with_lease",
    "unexpected_exception",
    "actor_crashed",
    "backward_since_accepted",
    "lease_expired_early",
    "leak_after_sweep",
    "history_incomplete",
    "actor_hung",
    "runner_error",
    "heartbeat_thread_dead",
    "unverified_replay_accepted",
)

WRITE_OPS = ("caa", "append")
# Injected interrupts (``testing.hooks``): an op they end is ``info``, not a bug.
INTERRUPT_TYPES = ("Interrupt", "Cancelled")
LEASE_SLACK_MS = 100.0
WALL_SLACK_MS = 50.0


@dataclass
class Violation:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class CheckReport:
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, kind: str, detail: str) -> None:
        assert kind in VIOLATION_KINDS, kind
        self.violations.append(Violation(kind, detail))

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(v.kind for v in self.violations))

    def summary(self, limit: int = 20) -> str:
        lines = [f"{len(self.violations)} violation(s): {self.by_kind()}"]
        lines += [f"  {v}"[:400] for v in self.violations[:limit]]
        return "\n".join(lines)


# ----- reading the consensus log ------------------------------------------------------------


def load_consensus_log(cfg: HistoryConfig, consensus: Consensus, report: CheckReport) -> dict[int, bytes]:
    """Every entry ever committed: archived ones plus what is still in consensus."""
    shard = cfg.shard_id
    archived: dict[int, tuple[str, bytes]] = {}
    for path in sorted(Path(cfg.archive_dir).glob("*.jsonl")):
        for raw in path.read_bytes().split(b"\n"):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # torn by kill -9
            if rec.get("key") != shard:
                continue
            s, sha = int(rec["seqno"]), rec["sha"]
            data = base64.b64decode(rec["data"])
            prev = archived.get(s)
            if prev is not None and prev[0] != sha:
                report.add("consensus_entry_rewritten", f"seqno {s} was archived with two different values")
            archived.setdefault(s, (sha, data))
    current: dict[int, bytes] = {}
    frm = 0
    while True:
        page = consensus.scan(shard, frm, 1024)
        for e in page:
            if e.seqno in current and current[e.seqno] != e.data:
                report.add("consensus_fork", f"two different entries at seqno {e.seqno}")
            current.setdefault(e.seqno, e.data)
        if len(page) < 1024:
            break
        frm = page[-1].seqno + 1
    head = max(current) if current else None
    for s, (sha, _) in archived.items():
        if s in current and hashlib.sha256(current[s]).hexdigest() != sha:
            report.add("consensus_entry_rewritten", f"seqno {s} differs from its archived value")
    top_archived = max(archived) if archived else None
    if top_archived is not None and (head is None or top_archived > head):
        report.add(
            "consensus_head_regressed",
            f"seqno {top_archived} was committed (archived) but the final head is {head}",
        )
    log: dict[int, bytes] = {s: d for s, (_, d) in archived.items()}
    log.update(current)
    if log:
        missing = [s for s in range(1, max(log) + 1) if s not in log]
        if missing:
            report.add("consensus_gap", f"{len(missing)} seqnos missing, first {missing[:5]}")
    return log


def replay(shard: str, log: dict[int, bytes], report: CheckReport) -> list[st.ShardState]:
    """States at seqnos 1..n (index = seqno; index 0 is the empty state)."""
    states = [st.ShardState(shard)]
    cur = states[0]
    for s in range(1, (max(log) if log else 0) + 1):
        data = log.get(s)
        if data is None:
            break
        try:
            cur = st.apply_diff(cur, unframe(data, shard=shard, what=f"entry {s}"), s)
        except PersistError as e:
            report.add("state_undecodable", f"seqno {s}: {e}")
            break
        states.append(cur)
    return states


# ----- parts ---------------------------------------------------------------------------------------


class PartReader:
    """Decodes parts from blob or the graveyard, verified, cached by checksum."""

    def __init__(self, cfg: HistoryConfig, report: CheckReport) -> None:
        from persist_lib.shard.codec import Schemas

        self.blob = FileBlob(cfg.blob_dir)
        self.graveyard = FileBlob(cfg.graveyard_dir)
        self.schemas = Schemas.create(KEY_SCHEMA, VAL_SCHEMA)
        self.shard = cfg.shard_id
        self.report = report
        self._cache: dict[str, list[model.Row] | None] = {}
        self._missing_reported: set[str] = set()

    def rows(self, p: PartMeta) -> list[model.Row] | None:
        ck = p.sha256
        if ck in self._cache:
            return self._cache[ck]
        from persist_lib.shard.parts import decode_part

        data = p.inline
        if data is None and p.key is not None:
            data = self.blob.get(p.key)
            if data is None:
                data = self.graveyard.get(p.key)
        if data is None:
            if p.location not in self._missing_reported:
                self._missing_reported.add(p.location)
                self.report.add("part_missing", f"part {p.location} is in neither blob nor graveyard")
            self._cache[ck] = None
            return None
        try:
            t = decode_part(
                data, self.schemas, expected_sha256=p.sha256, expected_size=p.size,
                shard=self.shard, key=p.location,
            )
        except PersistError as e:
            self.report.add("part_missing", f"part {p.location} does not decode: {e}")
            self._cache[ck] = None
            return None
        cols = [c.to_pylist() for c in t.columns]
        rows = list(zip(cols[0], cols[1], cols[-2], cols[-1], strict=True))
        self._cache[ck] = rows
        return rows

    def batch_rows(self, parts: Iterable[PartMeta]) -> list[model.Row] | None:
        out: list[model.Row] = []
        for p in parts:
            r = self.rows(p)
            if r is None:
                return None
            out += r
        return out


# ----- the checks ---------------------------------------------------------------------------------


@dataclass
class Commit:
    seqno: int
    writer_id: str
    lower: int
    upper: int
    rows: list[model.Row] | None
    walltime_ms: int = 0
    op: Op | None = None


def _t(a: Any) -> int | None:
    return a.time if a is not None else None


def check_states(states: list[st.ShardState], report: CheckReport) -> None:
    prev: st.ShardState | None = None
    for s in states[1:]:
        trace = s.trace_batches()
        if trace:
            if trace[0][1].lower.time != 0:
                report.add("trace_not_contiguous", f"seqno {s.seqno}: trace starts at {trace[0][1].lower}")
            for (_, a), (_, b) in zip(trace, trace[1:], strict=False):
                if a.upper != b.lower:
                    report.add("trace_not_contiguous", f"seqno {s.seqno}: {a.upper} != {b.lower}")
                    break
            if trace[-1][1].upper != s.upper:
                report.add("trace_not_contiguous", f"seqno {s.seqno}: trace ends at {trace[-1][1].upper}, upper {s.upper}")
        keys: Counter[str] = Counter(k for _, b in trace for k in b.blob_keys())
        dup = [k for k, n in keys.items() if n > 1]
        if dup:
            report.add("part_referenced_twice", f"seqno {s.seqno}: {dup[:3]}")
        for bid, b in trace:
            # A since at or below the batch's lower claims nothing; above it, times in
            # [lower, since) may have been forwarded, which needs since <= shard since.
            if s.since < b.since and b.lower < b.since:
                report.add("batch_since_beyond_shard_since", f"seqno {s.seqno}: batch {bid} since {b.since} > {s.since}")
        if prev is not None:
            if s.upper < prev.upper:
                report.add("upper_regressed", f"seqno {s.seqno}: {prev.upper} -> {s.upper}")
            if s.since < prev.since:
                report.add("since_regressed", f"seqno {s.seqno}: {prev.since} -> {s.since}")
            for rid, r in s.leased_readers.items():
                p = prev.leased_readers.get(rid)
                if p is None:
                    continue
                if r.since < p.since:
                    report.add("reader_since_regressed", f"seqno {s.seqno}: reader {rid} {p.since} -> {r.since}")
                if r.seqno < p.seqno:
                    report.add("reader_hold_regressed", f"seqno {s.seqno}: reader {rid} {p.seqno} -> {r.seqno}")
        prev = s


def find_commits(states: list[st.ShardState], parts: PartReader) -> list[Commit]:
    out: list[Commit] = []
    for i in range(1, len(states)):
        prev, s = states[i - 1], states[i]
        for wid, w in s.writers.items():
            pw = prev.writers.get(wid)
            if w.most_recent_write_token is None:
                continue
            if pw is not None and pw.most_recent_write_token == w.most_recent_write_token:
                continue
            new_ids = [bid for bid in s.batches if bid not in prev.batches]
            ps = [p for bid in new_ids for p in s.batches[bid].parts]
            rows = parts.batch_rows(ps)
            out.append(Commit(s.seqno, wid, prev.upper.time or 0, s.upper.time or 0, rows, s.walltime_ms))
    return out


def _op_rows(op: Op) -> Counter[tuple[str, int, int]]:
    return model.consolidate((k, v, t, d) for k, v, t, d in op.args.get("updates", []))


def attribute(commits: list[Commit], hist: History, seed: int, report: CheckReport) -> None:
    """Matches every committed write to the logged op that made it.

    1. An acknowledged write reports the seqno it committed (``WriteHandle.last_commit_seqno``):
       that pins it to its commit exactly.
    2. A writer runs one op at a time and its commits are in seqno order, so an unpinned
       commit lies between the pinned ops of that writer around it (by seqno): only the
       ops invoked between them are candidates.
    An append that reports it was skipped (``WriteHandle.last_append_skipped``: the
    shard already held its times) committed nothing and is never a candidate: with
    skewed clocks it could otherwise look closer to a commit than the op that made it.
    3. Among those with the commit's bounds, one whose data equals the commit's is
       preferred (inserted keys carry the op id), an op that did not definitely fail is
       preferred, and the commit's walltime inside the op's [invoke, complete] window
       breaks remaining ties. Walltimes alone mislead: a clock that ran ahead (the skewed
       actors of the fault model) pushes every later walltime ahead too.
    """
    by_writer: dict[str, list[Op]] = defaultdict(list)
    pinned: dict[int, Op] = {}
    for o in hist.ops_of(*WRITE_OPS):
        wid = o.args.get("writer_id")
        if wid:
            by_writer[wid].append(o)
        if o.outcome == OK and isinstance(o.result, dict) and o.result.get("seqno") is not None:
            pinned[int(o.result["seqno"])] = o
    for ops in by_writer.values():
        ops.sort(key=lambda o: o.invoke_mono)
    pinned_ids = {o.id for o in pinned.values()}
    pin_seqno = {o.id: sq for sq, o in pinned.items()}

    def want_of(o: Op, c: Commit) -> Counter[tuple[str, int, int]]:
        if o.op == "caa":
            return _op_rows(o)
        return model.consolidate(definite_updates_rows(seed, c.lower, c.upper))

    for c in commits:
        p = pinned.get(c.seqno)
        if p is not None and p.args.get("writer_id") == c.writer_id:
            got_p = model.consolidate(c.rows) if c.rows is not None else None
            want_p = want_of(p, c)
            if got_p is not None and got_p != want_p:
                report.add("commit_data_mismatch", f"seqno {c.seqno} ({p.op} {p.id}): {model.counter_diff(got_p, want_p)}")
            c.op = p
            continue
        ops = by_writer.get(c.writer_id, [])
        lo_i, hi_i = -1, len(ops)
        for i, o in enumerate(ops):
            sq = pin_seqno.get(o.id)
            if sq is None:
                continue
            if sq < c.seqno:
                lo_i = max(lo_i, i)
            elif sq > c.seqno:
                hi_i = min(hi_i, i)
        cands = []
        for o in ops[lo_i + 1 : hi_i]:
            if o.id in pinned_ids:
                continue  # pinned to its own commit
            if o.outcome == OK and isinstance(o.result, dict) and o.result.get("skipped"):
                continue  # wrote nothing: the shard already held its times
            if o.op == "caa" and o.args["expected"] == c.lower and o.args["new"] == c.upper:
                cands.append(o)
            elif o.op == "append" and o.args["upper"] == c.upper and o.args["lower"] <= c.lower:
                cands.append(o)
        got = model.consolidate(c.rows) if c.rows is not None else None

        def distance(o: Op, c: Commit = c) -> float:
            end = o.complete_wall_ms if o.completed and o.complete_wall_ms is not None else float("inf")
            if o.invoke_wall_ms - WALL_SLACK_MS <= c.walltime_ms <= end + WALL_SLACK_MS:
                return 0.0
            return min(abs(c.walltime_ms - o.invoke_wall_ms), abs(c.walltime_ms - end))

        def rank(o: Op, c: Commit = c, got: Any = got) -> tuple[int, int, float]:
            same = got is None or got == want_of(o, c)
            return (0 if same else 1, 1 if o.outcome == FAIL else 0, distance(o))

        cands.sort(key=rank)
        if not cands:
            report.add(
                "unattributed_commit",
                f"seqno {c.seqno}: writer {c.writer_id} committed [{c.lower}, {c.upper}) that no logged op wrote",
            )
            continue
        match = cands[0]
        if got is not None and got != want_of(match, c):
            report.add(
                "commit_data_mismatch",
                f"seqno {c.seqno} ({match.op} {match.id}): {model.counter_diff(got, want_of(match, c))}",
            )
        c.op = match


def definite_updates_rows(seed: int, lo: int, hi: int) -> list[model.Row]:
    return [(u[0][0][0], u[0][1][0], u[1], u[2]) for u in definite_updates(seed, lo, hi)]


def check_write_outcomes(
    commits: list[Commit], hist: History, report: CheckReport, final_upper: int | None = None
) -> dict[str, int]:
    n: Counter[str] = Counter(c.op.id for c in commits if c.op is not None)
    stats: Counter[str] = Counter()
    for o in hist.ops_of(*WRITE_OPS):
        k = n.get(o.id, 0)
        stats[f"{o.op}_{o.outcome}"] += 1
        if o.outcome == INFO:
            stats["indeterminate_writes"] += 1
            stats["indeterminate_committed" if k else "indeterminate_not_committed"] += 1
        if k > 1:
            report.add("duplicate_commit", f"{o.op} {o.id} committed {k} times")
        if o.outcome == FAIL and k:
            report.add(
                "failed_write_committed",
                f"{o.op} {o.id} failed definitely ({o.error_type}: {(o.error or '')[:200]}) but committed",
            )
        if o.outcome == OK and o.op == "caa" and k == 0:
            report.add("acked_write_lost", f"caa {o.id} [{o.args['expected']}, {o.args['new']}) was acknowledged but never committed")
        if o.outcome == OK and o.op == "append" and final_upper is not None and final_upper < o.args["upper"]:
            # A definite append returns once the shard holds its times (written by it or another).
            report.add("acked_write_lost", f"append {o.id} up to {o.args['upper']} acknowledged, final upper {final_upper}")
    return dict(stats)


def check_realtime(commits: list[Commit], report: CheckReport) -> None:
    ops = []
    for c in commits:
        if c.op is None:
            continue
        o = c.op
        done = o.complete_mono if o.completed and o.complete_mono is not None else float("inf")
        ops.append((o.invoke_mono, done, c.seqno, o.id))
    by_done = sorted(ops, key=lambda x: x[1])
    j = 0
    best: tuple[int, str] | None = None
    for inv, _, seqno, oid in sorted(ops, key=lambda x: x[0]):
        while j < len(by_done) and by_done[j][1] < inv:
            if best is None or by_done[j][2] > best[0]:
                best = (by_done[j][2], by_done[j][3])
            j += 1
        if best is not None and best[0] >= seqno:
            report.add(
                "realtime_order",
                f"{best[1]} (seqno {best[0]}) completed before {oid} was invoked, but {oid} has seqno {seqno}",
            )


def check_reads(rows: list[model.Row], final_upper: int, hist: History, report: CheckReport) -> dict[str, int]:
    stats: Counter[str] = Counter()
    by_time = sorted(rows, key=lambda r: r[2])
    for o in hist.ops_of("snapshot", "snapshot_splits"):
        if o.outcome != OK:
            continue
        stats["snapshots_checked"] += 1
        as_of = int(o.args["as_of"])
        if as_of >= final_upper:
            report.add("read_beyond_upper", f"snapshot {o.id} as of {as_of} returned but the final upper is {final_upper}")
            continue
        got_rows = o.result or []
        if any(r[2] != as_of for r in got_rows):
            report.add("snapshot_mismatch", f"snapshot {o.id}: times not forwarded to as_of {as_of}")
        got = model.consolidate((k, v, t, d) for k, v, t, d in got_rows)
        want = model.snapshot(by_time, as_of)
        if got != want:
            report.add("snapshot_mismatch", f"snapshot {o.id} as of {as_of}: {model.counter_diff(got, want)}")
    listens: dict[str, list[Op]] = defaultdict(list)
    opened: dict[str, int] = {}
    for o in hist.ops:
        if o.op == "listen_open" and o.outcome == OK:
            opened[o.args["listen_id"]] = int(o.args["as_of"])
        elif o.op == "listen_next" and o.outcome == OK:
            listens[o.args["listen_id"]].append(o)
    for lid, nexts in listens.items():
        listen_as_of = opened.get(lid)
        if listen_as_of is None:
            continue
        stats["listens_checked"] += 1
        frontier = listen_as_of + 1
        acc: list[model.Row] = []
        for o in nexts:
            if o.args.get("frontier") != frontier:
                break  # a lost record: stop checking this listen rather than guess
            for ev in o.result or []:
                if ev["kind"] == "updates":
                    for k, v, t, d in ev["rows"]:
                        if t < frontier or (ev["upper"] is not None and t >= ev["upper"]):
                            report.add("listen_mismatch", f"listen {lid}: update at {t} outside [{frontier}, {ev['upper']})")
                        acc.append((k, v, t, d))
                else:
                    u = ev["upper"]
                    if u is not None and u > final_upper:
                        report.add("read_beyond_upper", f"listen {lid} progressed to {u} beyond the final upper {final_upper}")
                    got = model.consolidate(acc)
                    want = model.time_slice(by_time, listen_as_of + 1, u)
                    stats["listen_progress_checked"] += 1
                    if got != want:
                        report.add(
                            "listen_mismatch",
                            f"listen {lid} as of {listen_as_of} at progress {u}: {model.counter_diff(got, want)}",
                        )
                        break
                    if u is None:
                        break  # the shard was closed: nothing follows
                    frontier = u
    return dict(stats)


def check_contents(
    states: list[st.ShardState], commits: list[Commit], model_rows_by_seqno: list[tuple[int, list[model.Row]]],
    parts: PartReader, report: CheckReport,
) -> int:
    """Trace contents vs the model after every merge and at the end; returns versions checked."""
    commit_seqnos = {c.seqno for c in commits}
    checked = 0
    rows_upto: list[model.Row] = []
    k = 0
    for i in range(1, len(states)):
        s, prev = states[i], states[i - 1]
        while k < len(model_rows_by_seqno) and model_rows_by_seqno[k][0] <= s.seqno:
            rows_upto += model_rows_by_seqno[k][1]
            k += 1
        changed = s.batches is not prev.batches and dict(s.batches) != dict(prev.batches)
        if not ((changed and s.seqno not in commit_seqnos) or i == len(states) - 1):
            continue
        if s.since.is_empty():
            continue
        got_rows = parts.batch_rows(p for _, b in s.trace_batches() for p in b.parts)
        if got_rows is None:
            continue
        since = s.since.time
        got = model.advance(got_rows, since)
        want = model.advance(rows_upto, since)
        checked += 1
        if got != want:
            report.add("trace_contents_wrong", f"seqno {s.seqno} (since {since}): {model.counter_diff(got, want)}")
    return checked


def check_deletes(states: list[st.ShardState], hist: History, report: CheckReport) -> int:
    last_ref: dict[str, int] = {}
    last_latest_rollup: dict[str, int] = {}
    for s in states[1:]:
        for _, b in s.batches.items():
            for k in b.blob_keys():
                last_ref[k] = s.seqno
        lr = s.latest_rollup()
        if lr is not None:
            last_latest_rollup[lr[1].key] = s.seqno
    n = 0
    seen: set[str] = set()
    for rec in hist.by_kind("blob_delete"):
        h = rec.get("head_before")
        if h is None or h >= len(states) or h <= 0:
            continue
        n += 1
        key = rec["key"]
        hold = states[h].seqno_since()
        if key in last_ref and last_ref[key] >= hold and key not in seen:
            seen.add(key)
            report.add(
                "reachable_blob_deleted",
                f"{rec['actor']}.{rec['inc']} deleted {key} at head {h} (seqno hold {hold}) but version "
                f"{last_ref[key]} references it",
            )
        if key in last_latest_rollup and last_latest_rollup[key] >= h and key not in seen:
            seen.add(key)
            report.add("live_rollup_deleted", f"rollup {key} deleted at head {h} is the latest rollup of version {last_latest_rollup[key]}")
    return n


_HEARTBEATING = {
    "reader": {"open_reader", "downgrade_since", "reader_heartbeat"},
    "writer": {"open_writer", "caa", "writer_heartbeat"},
}


def check_clients(hist: History, cfg: HistoryConfig, report: CheckReport) -> None:
    for o in hist.ops:
        et = o.error_type or ""
        if et == "CorruptionError":
            report.add("corruption_observed", f"{o.op} {o.id}: {(o.error or '')[:300]}")
        elif et == "BlobNotFound":
            report.add("blob_not_found_with_lease", f"{o.op} {o.id}: {(o.error or '')[:300]}")
        elif (
            o.completed
            and o.outcome == INFO
            and not et.endswith("Indeterminate")
            and et not in INTERRUPT_TYPES
        ):
            report.add("unexpected_exception", f"{o.op} {o.id}: {et}: {(o.error or '')[:600]}")
        if o.op == "downgrade_since_backward" and o.outcome == OK:
            report.add("backward_since_accepted", f"{o.id}: since {o.args['since']} -> {o.args['new_since']} accepted")
        if o.op == "verified_append" and o.outcome == OK:
            # Its updates differ from the committed ones: it must have stopped.
            report.add(
                "unverified_replay_accepted",
                f"{o.id}: a divergent replay of [{o.args['lower']}, {o.args['upper']}) returned "
                f"normally (its reader's since: {(o.result or {}).get('since')})",
            )
    for rec in hist.records:
        t = rec.get("type")
        if t == "unexpected_error":
            kind = "corruption_observed" if rec.get("error_type") == "CorruptionError" else "blob_not_found_with_lease"
            report.add(kind, f"{rec['actor']}.{rec['inc']}: {rec.get('error', '')[:300]}")
        elif t == "consensus_head_regressed":
            report.add(
                "consensus_head_regressed",
                f"{rec['actor']}.{rec['inc']}: CAS expected {rec.get('expected')} but the head was {rec.get('head')}",
            )
        elif t == "crash_unexpected":
            report.add("actor_crashed", f"{rec['actor']}.{rec['inc']}: {rec.get('error', '')[:600]}")
        elif t == "heartbeat_thread_dead":
            report.add(
                "heartbeat_thread_dead",
                f"{rec['actor']}.{rec['inc']}: the heartbeat thread died with {rec.get('handles')} handle(s) to keep",
            )
    # Lease expiry: LeaseExpired at O after a heartbeat invoked at I means O - I >= lease.
    for role, idkey, lease in (("reader", "reader_id", cfg.reader_lease_ms), ("writer", "writer_id", cfg.writer_lease_ms)):
        last_hb: dict[str, float] = {}
        for o in sorted(hist.ops, key=lambda o: o.invoke_mono):
            hid = o.args.get(idkey) or ((o.result or {}).get(idkey) if isinstance(o.result, dict) else None)
            if hid is None:
                continue
            if o.op in _HEARTBEATING[role] and o.outcome == OK:
                last_hb[hid] = max(last_hb.get(hid, 0.0), o.invoke_wall_ms)
            if o.error_type == "LeaseExpired" and hid in last_hb and o.complete_wall_ms is not None:
                gap = o.complete_wall_ms - last_hb[hid]
                if gap < lease - cfg.lease_slack_ms:
                    report.add(
                        "lease_expired_early",
                        f"{role} {hid}: LeaseExpired {gap:.0f} ms after a heartbeat (lease {lease} ms) in {o.op} {o.id}",
                    )
                    last_hb.pop(hid)


def check_history(cfg: HistoryConfig, consensus: Consensus, extra: dict[str, Any] | None = None) -> CheckReport:
    """Runs every check on a finished history (actors stopped)."""
    report = CheckReport()
    hist = load_events(cfg.log_dir)
    log = load_consensus_log(cfg, consensus, report)
    states = replay(cfg.shard_id, log, report)
    parts = PartReader(cfg, report)
    check_states(states, report)
    commits = find_commits(states, parts)
    attribute(commits, hist, cfg.seed, report)
    stats: dict[str, Any] = {}
    stats.update(check_write_outcomes(commits, hist, report, states[-1].upper.time))
    check_realtime(commits, report)
    model_rows: list[model.Row] = []
    by_seqno: list[tuple[int, list[model.Row]]] = []
    for c in sorted(commits, key=lambda c: c.seqno):
        r = c.rows or []
        model_rows += r
        by_seqno.append((c.seqno, r))
    final = states[-1]
    final_upper = final.upper.time if final.upper.time is not None else 1 << 62
    stats.update(check_reads(model_rows, final_upper, hist, report))
    stats["versions_content_checked"] = check_contents(states, commits, by_seqno, parts, report)
    stats["deletes_audited"] = check_deletes(states, hist, report)
    check_clients(hist, cfg, report)
    if extra and extra.get("leaked_after_sweep"):
        report.add("leak_after_sweep", f"{extra['leaked_after_sweep']} blobs unreferenced after the final sweep")
    outcomes = Counter(o.outcome for o in hist.ops)
    stats.update(
        {
            "ops": len(hist.ops),
            "ops_ok": outcomes.get(OK, 0),
            "ops_fail": outcomes.get(FAIL, 0),
            "ops_info": outcomes.get(INFO, 0),
            "ops_by_kind": dict(Counter(o.op for o in hist.ops)),
            "commits": len(commits),
            "seqnos": len(states) - 1,
            "final_upper": final.upper.time,
            "final_since": final.since.time,
            "torn_lines": hist.torn_lines,
            "blob_deletes": len(hist.by_kind("blob_delete")),
            # Issue 13's fault model.
            "interrupted_ops": sum(1 for o in hist.ops if (o.error_type or "") in INTERRUPT_TYPES),
            "heartbeat_faults": len(hist.by_kind("heartbeat_fault_injected")),
            "sweeps": sum(1 for o in hist.ops if o.op == "sweep" and o.outcome == OK),
            "blobs_swept": sum(int(o.result or 0) for o in hist.ops if o.op == "sweep" and o.outcome == OK),
            "long_writes": sum(1 for o in hist.ops if o.op == "caa" and o.args.get("long")),
            "long_writes_ok": sum(
                1 for o in hist.ops if o.op == "caa" and o.args.get("long") and o.outcome == OK
            ),
            "fresh_start": int(cfg.fresh_start),
        }
    )
    faults: Counter[str] = Counter()
    last: dict[str, dict[str, int]] = {}
    for o in hist.ops:
        f = o.extra.get("faults")
        if f:
            last[o.process] = f
    for rec in hist.records:
        if rec.get("type") == "stop" and rec.get("faults"):
            last[f"{rec['actor']}.{rec['inc']}"] = rec["faults"]
    outages = Counter(r.get("fault") for r in hist.by_kind("outage"))
    for f in last.values():
        faults.update(f)
    stats["faults"] = dict(faults)
    stats["outages"] = dict(outages)
    report.stats = stats
    return report
