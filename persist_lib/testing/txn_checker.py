"""The transactions history checker: the final collections against what every operation
wrote, and every read against the final collections.

Ground truth is the collections as a fault-free reader sees them at the end (a snapshot
at 0 plus a listen to the upper, across every handover: ``txn_history.read_truth``),
consolidated per ``(key, value, time)``. Every row key names the operation, collection
and row index that wrote it (``txn_config.row_key``), so:

1. **Attribution**: every row of every collection belongs to a logged writer operation
   and holds the value it wrote, once (multiplicity 1, at one time, never retracted —
   a handover that copied wrongly shows up here too) — ``txn_unattributed_row``,
   ``txn_row_duplicated``.
2. **All or nothing**: an operation's rows are all there, in every collection it
   touched, or none is (``txn_partial``: half a transaction); an ``insert``/``txn``'s rows
   share one time across collections, a ``caa``'s rows lie at ``lower + i % 2``, and an
   acknowledged one's rows are at the time it returned (``txn_time_wrong``).
3. **Outcomes**: an acknowledged write is there (``txn_acked_lost``), a failed one is not
   (``txn_failed_committed``); a stale ``caa`` never succeeds (``txn_stale_caa_accepted``).
4. **Isolation**: at each time, a collection's new rows come from one operation
   (``txn_writers_mixed``: never a mix of two writers).
5. **Reads**: every ok snapshot equals the collection at its ``as_of``
   (``txn_snapshot_mismatch``); every listen's output, at each progress, equals the
   collection's updates in ``(as_of, progress)`` (``txn_listen_mismatch``); a snapshot at
   a time the txn log says is committed never times out (``txn_read_stuck``: readers
   finish what a dead committer left, metadata included).
6. **The log and the catalog at the end**: applied and tidied, nothing pending
   (``txn_log_not_tidied``); each collection's metadata upper at its committed upper
   (``txn_metadata_behind``); the log registers exactly the shards of the catalog's
   renditions (``txn_registration_leaked`` / ``txn_registration_missing``).
7. **Clients**: no ``CorruptionError``, ``BlobNotFound``, txn-log or apply-order error, or
   non-persist exception (``unexpected_exception``); the final read worked
   (``txn_final_read_failed``); the target operations completed (``history_incomplete``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from persist_lib.testing.checker import CheckReport, Violation
from persist_lib.testing.history import FAIL, OK, History, Op, load_events
from persist_lib.testing.txn_config import TxnHistoryConfig, parse_key

TXN_VIOLATION_KINDS: tuple[str, ...] = (
    "txn_unattributed_row",
    "txn_row_duplicated",
    "txn_partial",
    "txn_time_wrong",
    "txn_acked_lost",
    "txn_failed_committed",
    "txn_stale_caa_accepted",
    "txn_writers_mixed",
    "txn_snapshot_mismatch",
    "txn_listen_mismatch",
    "txn_read_stuck",
    "txn_log_not_tidied",
    "txn_metadata_behind",
    "txn_registration_leaked",
    "txn_registration_missing",
    "txn_final_read_failed",
    "unexpected_exception",
    "history_incomplete",
    "actor_crashed",
    "actor_hung",
    "runner_error",
)
WRITE_OPS = ("insert", "txn", "caa", "caa_stale")
# Errors no client of a correct implementation sees (the others are faults or races).
BAD_ERRORS = (
    "CorruptionError", "BlobNotFound", "TxnApplyOutOfOrder", "TxnLogCorrupt", "ShardsDisagree",
)


class TxnReport(CheckReport):
    """A ``CheckReport`` over the transactions history's violation kinds."""

    def add(self, kind: str, detail: str) -> None:
        assert kind in TXN_VIOLATION_KINDS, kind
        self.violations.append(Violation(kind, detail))


Contents = Counter[tuple[str, int]]  # (key, value) -> multiplicity


class Truth:
    """One collection's consolidated updates, and its contents at any time."""

    def __init__(self, updates: list[list[Any]]) -> None:
        acc: Counter[tuple[str, int, int]] = Counter()
        for k, v, t, d in updates:
            acc[(k, v, t)] += d
        self.updates = {kvt: d for kvt, d in acc.items() if d}
        self._at: dict[int, Contents] = {}

    def at(self, t: int) -> Contents:
        c = self._at.get(t)
        if c is None:
            c = Counter()
            for (k, v, ts), d in self.updates.items():
                if ts <= t:
                    c[(k, v)] += d
            c = self._at[t] = +c
        return c

    def between(self, lo: int, hi: int) -> dict[tuple[str, int, int], int]:
        """Consolidated updates at times in ``(lo, hi)``."""
        return {kvt: d for kvt, d in self.updates.items() if lo < kvt[2] < hi}


def check_txn_history(cfg: TxnHistoryConfig, truth: dict[str, Any]) -> TxnReport:
    report = TxnReport()
    hist = load_events(cfg.log_dir)
    _stats(report, hist)
    for e in truth.get("errors", []):
        report.add("txn_final_read_failed", e)
    colls = {name: Truth(c["updates"]) for name, c in truth.get("collections", {}).items()}
    _check_writes(report, hist, colls)
    _check_reads(report, hist, colls)
    _check_final(report, truth)
    for o in hist.ops:
        if o.error_type in BAD_ERRORS or (o.error and "Traceback" in o.error):
            report.add("unexpected_exception", f"{o.id} {o.op}: {o.error_type}: {(o.error or '')[:300]}")
    for r in hist.by_kind("crash_unexpected"):
        report.add("unexpected_exception", f"{r.get('actor')}: {str(r.get('error'))[:400]}")
    done = sum(1 for o in hist.ops if o.completed)
    if done < cfg.target_ops:
        report.add("history_incomplete", f"{done} of {cfg.target_ops} operations completed")
    return report


def _stats(report: TxnReport, hist: History) -> None:
    s = report.stats
    s["ops"] = len(hist.ops)
    for outcome in ("ok", "fail", "info"):
        s[f"ops_{outcome}"] = sum(1 for o in hist.ops if o.outcome == outcome)
    s["ops_by_kind"] = dict(Counter(o.op for o in hist.ops))
    s["kill_points"] = dict(Counter(str(r.get("point")) for r in hist.by_kind("self_kill")))
    s["handovers"] = sum(1 for o in hist.ops_of("handover") if o.outcome == OK and "at" in (o.result or {}))
    s["torn_lines"] = hist.torn_lines


def _check_writes(report: TxnReport, hist: History, colls: dict[str, Truth]) -> None:
    ops = {o.id: o for o in hist.ops_of(*WRITE_OPS)}
    seen: dict[str, dict[tuple[str, int], int]] = defaultdict(dict)  # op -> (coll, i) -> time
    by_time: dict[tuple[str, int], set[str]] = defaultdict(set)  # (coll, time) -> ops
    for coll, tr in colls.items():
        keys: Counter[str] = Counter()
        for (k, v, t), d in tr.updates.items():
            keys[k] += 1
            parsed = parse_key(k)
            if parsed is None or parsed[0] not in ops or parsed[1] != coll or parsed[2] != v:
                report.add("txn_unattributed_row", f"{coll}: ({k}, {v}) at {t} x{d}: no operation wrote it")
                continue
            if d != 1:
                report.add("txn_row_duplicated", f"{coll}: ({k}, {v}) at {t} has multiplicity {d}")
            seen[parsed[0]][(coll, parsed[2])] = t
            by_time[(coll, t)].add(parsed[0])
        for k, n in keys.items():
            if n > 1:
                report.add("txn_row_duplicated", f"{coll}: {k} appears at {n} times or values")
    for (coll, t), who in sorted(by_time.items()):
        if len(who) > 1:
            report.add("txn_writers_mixed", f"{coll} at {t}: rows of {sorted(who)} (one write per time)")
    for oid, o in ops.items():
        _check_op(report, o, seen.get(oid, {}))
    report.stats["txns_committed"] = len(seen)
    report.stats["txns_committed_multi_collection"] = sum(
        1 for got in seen.values() if len({c for c, _i in got}) > 1
    )


def _check_op(report: TxnReport, o: Op, got: dict[tuple[str, int], int]) -> None:
    want = {(c, i) for c, n in (o.args.get("rows") or {}).items() for i in range(int(n))}
    if o.op == "caa_stale" and o.outcome == OK:
        report.add("txn_stale_caa_accepted", f"{o.id}: a compare-and-append below the upper returned ok")
    if not got:
        if o.outcome == OK:
            report.add("txn_acked_lost", f"{o.id} {o.op} {o.args.get('rows')} returned {o.result} but is not there")
        return
    if o.outcome == FAIL:
        report.add("txn_failed_committed", f"{o.id} {o.op} failed ({o.error_type}) but {len(got)} rows are there")
    if set(got) != want:
        report.add(
            "txn_partial",
            f"{o.id} {o.op}: {len(got)} of {len(want)} rows there "
            f"(missing {sorted(want - set(got))[:6]}) — half a transaction",
        )
    times = set(got.values())
    if o.op in ("insert", "txn"):
        if len(times) != 1 or (o.outcome == OK and times != {o.result}):
            report.add("txn_time_wrong", f"{o.id} {o.op}: rows at {sorted(times)}, returned {o.result}")
    else:
        lowers = {t - i % 2 for (_c, i), t in got.items()}
        if len(lowers) != 1 or (o.outcome == OK and lowers != {o.result}):
            report.add("txn_time_wrong", f"{o.id} {o.op}: rows at lowers {sorted(lowers)}, returned {o.result}")


def _check_reads(report: TxnReport, hist: History, colls: dict[str, Truth]) -> None:
    for o in hist.ops_of("snapshot"):
        tr = colls.get(o.args["coll"])
        as_of = int(o.args["as_of"])
        if o.outcome != OK:
            if o.error_type == "Timeout" and as_of < int(o.args["committed_upper"]):
                report.add(
                    "txn_read_stuck",
                    f"{o.id}: snapshot of {o.args['coll']} at {as_of} (committed upper "
                    f"{o.args['committed_upper']}) timed out: {(o.error or '')[:200]}",
                )
            continue
        if tr is None:
            continue
        got: Contents = Counter()
        for k, v, d in o.result:
            got[(k, v)] += d
        want = tr.at(as_of)
        if +got != want:
            report.add(
                "txn_snapshot_mismatch",
                f"{o.id}: {o.args['coll']} at {as_of}: extra {sorted((+got - want).items())[:4]}, "
                f"missing {sorted((want - got).items())[:4]}",
            )
    listens: dict[str, list[Op]] = defaultdict(list)
    for o in hist.ops_of("listen_next"):
        if o.outcome == OK:
            listens[o.args["listen"]].append(o)
    for lid, steps in listens.items():
        _check_listen(report, lid, steps, colls)


def _check_listen(report: TxnReport, lid: str, steps: list[Op], colls: dict[str, Truth]) -> None:
    coll, as_of = steps[0].args["coll"], int(steps[0].args["as_of"])
    tr = colls.get(coll)
    if tr is None:
        return
    acc: Counter[tuple[str, int, int]] = Counter()
    for o in sorted(steps, key=lambda x: x.invoke_mono):
        for ev in o.result:
            if ev[0] == "u":
                _, k, v, t, d = ev
                acc[(k, v, t)] += d
                continue
            upper = ev[1]
            if upper is None:
                continue
            got = {kvt: d for kvt, d in acc.items() if d}
            want = tr.between(as_of, upper)
            if got != want:
                extra = sorted(set(got.items()) - set(want.items()))[:4]
                missing = sorted(set(want.items()) - set(got.items()))[:4]
                report.add(
                    "txn_listen_mismatch",
                    f"listen {lid} on {coll} from {as_of}, at progress {upper}: extra {extra}, missing {missing}",
                )
                return


def _check_final(report: TxnReport, truth: dict[str, Any]) -> None:
    log = truth.get("log")
    if log is None:
        return
    if log["pending"] or log["advances"]:
        report.add("txn_log_not_tidied", f"after apply and tidy the log still holds {log}")
    for name, c in truth.get("collections", {}).items():
        if c["metadata_upper"] != [c["committed_upper"]] and c["committed_upper"] > 0:
            report.add(
                "txn_metadata_behind",
                f"{name}: metadata upper {c['metadata_upper']}, committed upper {c['committed_upper']}",
            )
    registered, live = set(log["registered"]), set(truth.get("catalog_shards", []))
    if registered - live:
        report.add("txn_registration_leaked", f"registered but no rendition's: {sorted(registered - live)[:4]}")
    if live - registered:
        report.add("txn_registration_missing", f"a rendition's but not registered: {sorted(live - registered)[:4]}")
