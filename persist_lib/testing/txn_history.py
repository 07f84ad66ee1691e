"""The transactions history runner: collections and transactions, real OS processes,
faults, kill -9 at every step of the protocol, a checker.

``run_txn_history(cfg)``:

1. creates the transactional collections ``txn_config.COLLECTIONS`` (fault-free);
2. starts the actors (``txn_actors``: writers, readers, a handover actor, maintenance)
   as processes through the shard histories' ``forkserver`` context; an actor that
   killed itself at a protocol step (``KillSwitch``) or that the nemesis killed
   (``kill -9`` every ``crash_mean_interval_s``) is restarted as a new incarnation;
3. stops at ``target_ops`` completed operations (or ``time_limit_s``);
4. a fault-free final phase: a new controller recovers (rolls back a half-made
   rendition of a killed handover: its registrations are forgotten), applies and tidies
   the log, then reads every collection whole (a snapshot at 0 and a listen to its
   upper) and writes that, with the log's and the catalog's state, to ``truth.json``;
5. checks the history against it (``txn_checker``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import traceback
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from persist_lib.testing.actor_location import build_location
from persist_lib.testing.history import EventLog
from persist_lib.testing.history_config import prepare_dirs
from persist_lib.testing.runner import (
    HistoryResult,
    _context,
    _Counter,
    _drive,
    starter,
    stop_actors,
)
from persist_lib.testing.txn_actors import txn_actor_main
from persist_lib.testing.txn_checker import TxnReport, check_txn_history
from persist_lib.testing.txn_config import COLLECTIONS, KEY, VAL, TxnHistoryConfig, committed_upper


def txn_config(seed: int, root: str, consensus_uri: str, **overrides: Any) -> TxnHistoryConfig:
    """A transactions history's configuration; knobs vary with the seed."""
    from persist_lib.txn.log import default_txn_log_shard

    rng = random.Random(f"txn-config/{seed}")
    cfg = TxnHistoryConfig(
        seed=seed, root=root, consensus_uri=consensus_uri, shard_id=str(default_txn_log_shard()),
        target_ops=300, writers=3, readers=2,
        unreliability=rng.choice([0.0, 0.01, 0.02]),
        outage_mean_interval_s=0.0,  # total outages would stall every committer at once
        crash_mean_interval_s=2.0, max_crashes=4,
        inline_threshold=rng.choice([0, 4096]),
        rollup_interval=rng.choice([8, 16, 32]),
        background_compaction=rng.random() < 0.3,
        txn_kill_rate=rng.choice([0.1, 0.15, 0.2]),
        time_limit_s=150.0,
    )
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise TypeError(f"TxnHistoryConfig has no field {k!r}")
        setattr(cfg, k, v)
    return cfg


@dataclass
class TxnHistoryResult(HistoryResult):
    """A finished, checked transactions history (``planned_kills``: kills at protocol
    steps by the actors themselves; ``crashes``: the nemesis's)."""

    def describe(self) -> str:
        s = self.report.stats
        return (
            f"txn seed {self.cfg.seed} ({self.cfg.consensus_uri.split(':')[0]}, planted {self.cfg.planted}): "
            f"{s.get('ops')} ops ({s.get('ops_ok')} ok / {s.get('ops_fail')} fail / {s.get('ops_info')} info), "
            f"{s.get('txns_committed')} transactions in the collections, {s.get('handovers')} handovers, "
            f"kills at protocol steps {s.get('kill_points')}, {self.crashes} nemesis kills, "
            f"{self.duration_s:.1f}s; {self.report.summary(8)}"
        )


def _actors(cfg: TxnHistoryConfig) -> list[str]:
    names = [f"tw{i}" for i in range(cfg.writers)] + [f"tr{i}" for i in range(cfg.readers)]
    return names + (["th"] if cfg.txn_handovers else []) + (["tm"] if cfg.txn_maintenance else [])


def _open_ctl(cfg: TxnHistoryConfig, *, recover: bool) -> Any:
    from persist_lib.storage.controller import StorageController

    loc = build_location(cfg, None, "final.jsonl", faults=False, seed=cfg.seed)
    return StorageController(loc.client, recover=recover)


def _create(cfg: TxnHistoryConfig) -> None:
    ctl = _open_ctl(cfg, recover=True)
    try:
        for name, shards in sorted(COLLECTIONS.items()):
            ctl.create_collection(name, KEY, VAL, num_shards=shards, transactional=True)
    finally:
        ctl.close()
        ctl.client.close()


def read_truth(cfg: TxnHistoryConfig) -> dict[str, Any]:
    """Fault-free: recover, apply and tidy, read every collection whole (see the module
    docstring); also what the log and the catalog hold then."""
    out: dict[str, Any] = {"collections": {}, "errors": []}
    ctl = _open_ctl(cfg, recover=True)
    try:
        out["recovered"] = ctl.recover()
        out["applied"] = ctl.txns.apply_all()
        out["tidied"] = ctl.txns.tidy()
        for name in sorted(COLLECTIONS):
            try:
                r = ctl.acquire_read_handle(name)
                upper = r.upper.time or 0
                ups: list[list[Any]] = []
                if upper > 0:
                    ups = [[x["k"], x["v"], 0, x["diff"]] for x in r.snapshot(0, timeout_s=10).to_pylist()]
                    with r.listen(0) as listen:
                        t = listen.read_until(upper, timeout_s=30)
                    ups += [[x["k"], x["v"], x["ts"], x["diff"]] for x in t.to_pylist()]
                d = ctl.describe(name)
                out["collections"][name] = {
                    "upper": upper, "updates": ups, "metadata_upper": d["metadata_upper"],
                    "committed_upper": committed_upper(ctl, name), "active": d["active_rendition"],
                    "timeline": d["timeline"],
                }
                r.expire()
            except Exception as e:  # noqa: BLE001 - the checker reports it
                out["errors"].append(f"reading {name}: {type(e).__name__}: {e}"[:1500])
        view = ctl.txns.log.read()
        cat, _ = ctl.catalog.load()
        out["log"] = {"pending": len(view.pending), "advances": len(view.advances),
                      "registered": sorted(view.registered)}
        out["catalog_shards"] = sorted(
            s for spec in cat.values() for info in spec["renditions"].values()
            if info["status"] not in ("dropped",) for s in info["shards"]
        )
    except Exception:  # noqa: BLE001
        out["errors"].append(traceback.format_exc()[-1500:])
    finally:
        ctl.close()
        ctl.client.close()
    return out


def run_txn_history(cfg: TxnHistoryConfig) -> TxnHistoryResult:
    """Runs one transactions history to completion and checks it."""
    t0 = time.monotonic()
    prepare_dirs(cfg)
    res = TxnHistoryResult(cfg, TxnReport())
    nlog = EventLog(os.path.join(cfg.log_dir, "nemesis.0.jsonl"), "nemesis", 0)
    procs: dict[str, BaseProcess] = {}
    incs: dict[str, int] = {}
    start = starter(_context(), txn_actor_main, cfg.to_json(), procs, incs, nlog)
    try:
        _create(cfg)
        for name in _actors(cfg):
            start(name)
        rng = random.Random(f"txn-nemesis/{cfg.seed}")
        # An actor killed by its own SIGKILL (exit -9) was killed at a protocol step on purpose.
        _drive(cfg, res, procs, incs, start, _Counter(cfg.log_dir), rng, nlog, t0, lambda p: p.exitcode == -9)
    except Exception:  # noqa: BLE001 - the history is still checked
        res.runner_errors.append(traceback.format_exc())
    finally:
        stop_actors(cfg, res, procs, incs, nlog)
    truth = read_truth(cfg)
    Path(cfg.truth_path).write_text(json.dumps(truth))
    try:
        res.report = check_txn_history(cfg, truth)
    except Exception:  # noqa: BLE001
        res.runner_errors.append(traceback.format_exc())
    for tb in res.runner_errors:
        res.report.add("runner_error", tb[-1500:])
    if res.restarts_unexpected:
        res.report.add("actor_crashed", f"{res.restarts_unexpected} actor process(es) died on their own")
    if res.hung:
        res.report.add("actor_hung", f"did not stop within 20 s: {res.hung}")
    res.report.stats.update(crashes=res.crashes, planned_kills=res.planned_kills)
    res.duration_s = time.monotonic() - t0
    return res


def keep_or_remove(res: TxnHistoryResult) -> None:
    """Removes a clean history's directory (a violating one is kept for replay)."""
    if res.ok:
        shutil.rmtree(res.cfg.root, ignore_errors=True)


# What a transactions history with each planted txn bug must show (any one kind), and the
# configuration that exposes it: tidy_before_apply needs committers killed between
# applies (a whole unapplied transaction that is tidied away was an ``info`` op: losing it
# is allowed; half of one is not); reader_skips_apply needs a committed, unapplied time that
# nobody else applies before a reader reads it (no maintenance, one slow writer killed
# right after its commit CAS, a short read timeout).
TXN_HISTORY_EXPECT: dict[str, tuple[set[str], dict[str, Any]]] = {
    "txn_apply_without_commit": (
        {"txn_failed_committed", "txn_partial", "txn_writers_mixed", "txn_final_read_failed",
         "unexpected_exception", "txn_read_stuck"},
        {},
    ),
    "txn_tidy_before_apply": (
        {"txn_partial", "txn_acked_lost", "txn_writers_mixed", "txn_read_stuck", "txn_metadata_behind"},
        {"txn_kill_points": ["between_applies"], "txn_kill_rate": 0.4},
    ),
    "txn_reader_skips_apply": (
        {"txn_read_stuck"},
        {"txn_maintenance": False, "writers": 1, "txn_kill_points": ["after_commit_cas"],
         "txn_kill_rate": 0.5, "txn_writer_pause_s": (0.8, 1.5), "txn_read_timeout_s": 1.5},
    ),
}


def txn_history_catches(
    name: str, seed: int, root: str, uri_for: Any, *, target_ops: int = 150, attempts: int = 3
) -> tuple[bool, str]:
    """Runs up to ``attempts`` short transactions histories with planted bug ``name``
    (``uri_for(dir)`` gives each one's consensus URI); returns whether one showed an
    expected violation, and what it showed."""
    kinds, overrides = TXN_HISTORY_EXPECT[name]
    detail = ""
    for attempt in range(attempts):
        d = f"{root}/{attempt}"
        cfg = txn_config(seed + 10 * attempt, d, uri_for(d), target_ops=target_ops, planted=[name], **overrides)
        res = run_txn_history(cfg)
        hit = res.report.by_kind().keys() & kinds
        if hit:
            return True, f"attempt {attempt + 1}: {sorted(hit)}"
        detail = res.describe()
    return False, detail
