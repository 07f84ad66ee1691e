"""The history runner: one shard, real OS processes, faults, a crash nemesis, a checker.

``run_history(cfg)``:

1. creates the shard (fault-free) and starts every actor as its own process through a
   multiprocessing ``forkserver`` context (the server preloads the harness once, so
   the nemesis can kill and restart actors cheaply; each actor is still a separate OS
   process with its own connections, so CAS contention is real);
2. while the history runs, the nemesis ``kill -9``s a random actor every
   ``crash_mean_interval_s`` (exponential) and restarts it as a new incarnation (new
   handles, new op ids); an actor that dies on its own is restarted too and reported;
3. stops when ``target_ops`` operations completed (or at ``time_limit_s``): creates the
   stop file, waits for the actors to release their handles, kills stragglers;
4. a fault-free final phase: expires every lease, runs GC, sweeps leaked blobs (grace 0
   and no in-flight guard: nothing else runs now) and counts what is still unreferenced
   after the sweep;
5. checks the history (``persist_lib.testing.checker``).

The seed determines the shard id, every actor's RNG (operations, fault injection and
outage schedule) and the nemesis schedule; OS scheduling is the only other input.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from persist_lib.testing.actor_location import build_location
from persist_lib.testing.actors import actor_main
from persist_lib.testing.checker import CheckReport, check_history
from persist_lib.testing.history import OK, EventLog
from persist_lib.testing.history_config import KEY_SCHEMA, VAL_SCHEMA, HistoryConfig, prepare_dirs

_CTX: Any = None  # the forkserver context (typed loosely: BaseContext lacks Process)
_CTX_LOCK = threading.Lock()


def _context() -> Any:
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(
                ["persist_lib.testing.actors", "persist_lib.testing.txn_actors", "persist_lib.testing.planted"]
            )
            _CTX = ctx
        return _CTX


def shard_for_seed(seed: int) -> str:
    rng = random.Random(f"shard/{seed}")
    return "s" + str(uuid.UUID(int=rng.getrandbits(128), version=4))


def default_config(seed: int, root: str, consensus_uri: str, **overrides: Any) -> HistoryConfig:
    """A history configuration whose knobs vary with the seed (parts inline or in blob,
    rollup interval, background compaction)."""
    rng = random.Random(f"config/{seed}")
    cfg = HistoryConfig(
        seed=seed,
        root=root,
        consensus_uri=consensus_uri,
        shard_id=shard_for_seed(seed),
        inline_threshold=rng.choice([0, 0, 4096]),
        inline_max_total=rng.choice([1 << 20, 4096]),
        rollup_interval=rng.choice([4, 8, 16, 32]),
        background_compaction=rng.random() < 0.3,
        # Issue 13's wider fault model (actors.py docstring).
        interrupt_rate=rng.choice([0.0, 0.01, 0.02]),
        actor_clock_skew_ms=rng.choice([0, 100, 250]),
        expirer_clock_ahead_ms=rng.choice([0, 300, 700]),
        sweeper_clock_ahead_ms=rng.choice([2, 6, 48]) * 3_600_000,
        sweep_rate=rng.choice([0.2, 0.4]),
        long_write_rate=rng.choice([0.05, 0.15]),
        heartbeat_fault_rate=rng.choice([0.0, 0.1, 0.3]),
        fresh_start=rng.random() < 0.3,
        # Issue 14: parts written unsorted (0: every part) in half the seeds.
        unsorted_min_bytes=rng.choice([None, 0]),
        # Merges that fit in memory sort all rows at once; or always stream (session 8).
        compaction_in_memory=rng.random() < 0.5,
        # Issue 26: divergent verified appends (from below the since) must stop.
        verified_append_rate=rng.choice([0.0, 0.04]),
        # Issue 28: merges keep retained history in time layers however small, in half
        # the seeds (drawn last: the draws above are those of earlier sessions).
        tiny_time_layers=rng.random() < 0.5,
    )
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise TypeError(f"HistoryConfig has no field {k!r}")
        setattr(cfg, k, v)
    return cfg


@dataclass
class HistoryResult:
    """A finished, checked history."""

    cfg: HistoryConfig
    report: CheckReport
    crashes: int = 0
    restarts_unexpected: int = 0
    hung: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    leaked_before_sweep: int = 0
    leaked_after_sweep: int = 0
    final_errors: list[str] = field(default_factory=list)
    runner_errors: list[str] = field(default_factory=list)
    stop_s: float = 0.0
    planned_kills: int = 0  # actors that SIGKILLed themselves on purpose (txn histories)

    @property
    def ok(self) -> bool:
        return self.report.ok

    def describe(self) -> str:
        s = self.report.stats
        return (
            f"seed {self.cfg.seed} ({self.cfg.consensus_uri.split(':')[0]}, planted {self.cfg.planted}): "
            f"{s.get('ops')} ops ({s.get('ops_ok')} ok / {s.get('ops_fail')} fail / {s.get('ops_info')} info), "
            f"{s.get('commits')} commits, {s.get('seqnos')} seqnos, {self.crashes} crashes, "
            f"faults {s.get('faults')}, {self.duration_s:.1f}s; {self.report.summary(8)}"
        )


class _Counter:
    """Counts ``complete`` records in the log directory, reading only new bytes."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._off: dict[str, int] = {}
        self.total = 0

    def poll(self) -> int:
        for p in Path(self.log_dir).glob("*.jsonl"):
            off = self._off.get(p.name, 0)
            try:
                with open(p, "rb") as f:
                    f.seek(off)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self.total += data[:end].count(b'"type":"complete"')
            self._off[p.name] = off + end
        return self.total


def _actors(cfg: HistoryConfig) -> list[str]:
    names = [f"w{i}" for i in range(cfg.writers)] + [f"r{i}" for i in range(cfg.readers)]
    names += [n for n, on in (("compactor", cfg.compactor), ("gc", cfg.gc), ("expirer", cfg.expirer)) if on]
    return names


def _create_shard(cfg: HistoryConfig) -> None:
    loc = build_location(cfg, None, "init.jsonl", faults=False, seed=cfg.seed)
    try:
        w = loc.client.open_writer(cfg.shard_id, KEY_SCHEMA, VAL_SCHEMA, purpose="init")
        w.expire()
    finally:
        loc.client.close()


def _final_phase(cfg: HistoryConfig, res: HistoryResult) -> None:
    """Fault-free: expire everything, GC, sweep leaked blobs, count what is left."""
    log = EventLog(os.path.join(cfg.log_dir, "final.0.jsonl"), "final", 0)
    loc = build_location(cfg, log, "final.0.jsonl", faults=False, seed=cfg.seed)
    c = loc.client

    def op(name: str, fn: Any) -> Any:
        oid = log.invoke(name, {})
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the checker decides
            log.complete(oid, "info", error=str(e), error_type=type(e).__name__)
            res.final_errors.append(f"{name}: {type(e).__name__}: {e}")
            return None
        log.complete(oid, OK, result=r if isinstance(r, int | dict | list) else str(r))
        return r

    try:
        far = int(time.time() * 1000) + 10 * 365 * 24 * 3600 * 1000
        op("final_expire_leases", lambda: c.expire_leases(cfg.shard_id, now=far))
        op("final_gc", lambda: c.gc(cfg.shard_id))
        op("final_gc", lambda: c.gc(cfg.shard_id))
        swept = op(
            "final_sweep", lambda: c.unreferenced_blobs(cfg.shard_id, 0, delete=True, quiescent=True)
        )
        res.leaked_before_sweep = len(swept or [])
        left = op(
            "final_leak_report",
            lambda: c.unreferenced_blobs(cfg.shard_id, 0, delete=False, quiescent=True),
        )
        res.leaked_after_sweep = len(left or [])
    finally:
        c.close()
        log.close()


def run_history(cfg: HistoryConfig, *, keep_dir: bool = True) -> HistoryResult:
    """Runs one history to completion and checks it."""
    t0 = time.monotonic()
    prepare_dirs(cfg)
    ctx = _context()
    rng = random.Random(f"nemesis/{cfg.seed}")
    nlog = EventLog(os.path.join(cfg.log_dir, "nemesis.0.jsonl"), "nemesis", 0)
    res = HistoryResult(cfg, CheckReport())
    if not cfg.fresh_start:
        _create_shard(cfg)  # else: every actor races to open a fresh location and shard
    procs: dict[str, BaseProcess] = {}
    incs: dict[str, int] = {}
    start = starter(ctx, actor_main, cfg.to_json(), procs, incs, nlog)
    for name in _actors(cfg):
        start(name)
    counter = _Counter(cfg.log_dir)
    try:
        _drive(cfg, res, procs, incs, start, counter, rng, nlog, t0)
    except Exception:  # noqa: BLE001 - recorded as a runner error; the history is still checked
        res.runner_errors.append(traceback.format_exc())
    finally:
        stop_actors(cfg, res, procs, incs, nlog)
    t_run = time.monotonic()
    try:
        _final_phase(cfg, res)
    except Exception:  # noqa: BLE001
        res.runner_errors.append(traceback.format_exc())
    t_final = time.monotonic()
    from persist_lib.testing import planted

    try:
        cons = planted.open_consensus(cfg.consensus_uri, cfg.planted)
        try:
            res.report = check_history(cfg, cons, {"leaked_after_sweep": res.leaked_after_sweep})
        finally:
            cons.close()
    except Exception:  # noqa: BLE001
        res.runner_errors.append(traceback.format_exc())
    for tb in res.runner_errors:
        res.report.add("runner_error", tb[-1500:])
    done = res.report.stats.get("ops", 0) - sum(
        n for k, n in res.report.stats.get("ops_by_kind", {}).items() if k.startswith("final_")
    )
    if done < cfg.target_ops:
        res.report.add("history_incomplete", f"{done} of {cfg.target_ops} operations completed in {cfg.time_limit_s}s")
    if res.restarts_unexpected:
        res.report.add("actor_crashed", f"{res.restarts_unexpected} actor process(es) died on their own")
    if res.hung:
        res.report.add("actor_hung", f"did not stop within 20 s: {res.hung}")
    res.report.stats["seconds"] = {
        "run": round(t_run - t0 - res.stop_s, 2),
        "stop": round(res.stop_s, 2),
        "final": round(t_final - t_run, 2),
        "check": round(time.monotonic() - t_final, 2),
    }
    res.report.stats["crashes"] = res.crashes
    res.report.stats["restarts_unexpected"] = res.restarts_unexpected
    res.report.stats["hung"] = len(res.hung)
    res.report.stats["leaked_before_sweep"] = res.leaked_before_sweep
    res.report.stats["leaked_after_sweep"] = res.leaked_after_sweep
    res.duration_s = time.monotonic() - t0
    if not keep_dir and res.ok:
        shutil.rmtree(cfg.root, ignore_errors=True)
    return res


def starter(
    ctx: Any, target: Any, cfg_json: str, procs: dict[str, BaseProcess], incs: dict[str, int], nlog: EventLog
) -> Any:
    """``start(name)``: starts (or restarts, as a new incarnation) actor ``name`` as a
    process running ``target(cfg_json, name, incarnation)``."""

    def start(name: str) -> None:
        incs[name] = incs.get(name, -1) + 1
        for attempt in range(3):
            p = ctx.Process(target=target, args=(cfg_json, name, incs[name]), name=f"actor-{name}")
            try:
                p.start()
                break
            except (OSError, EOFError) as e:  # the forkserver restarts on the next try
                nlog.note("start_failed", victim=name, error=f"{type(e).__name__}: {e}")
                if attempt == 2:
                    raise
                time.sleep(0.2)
        procs[name] = p

    return start


def stop_actors(
    cfg: HistoryConfig, res: HistoryResult, procs: dict[str, BaseProcess], incs: dict[str, int], nlog: EventLog
) -> None:
    """Creates the stop file, waits up to 20 s for the actors, kills stragglers (hung)."""
    t_stop = time.monotonic()
    Path(cfg.stop_path).touch()
    stop_deadline = time.monotonic() + 20.0
    for name, p in procs.items():
        p.join(max(0.1, stop_deadline - time.monotonic()))
        if p.is_alive():
            res.hung.append(f"{name}.{incs[name]}")
            nlog.note("hung", victim=name, inc=incs[name])
            _kill(p)
            p.join(5)
    nlog.close()
    res.stop_s = time.monotonic() - t_stop


def _kill(p: BaseProcess) -> None:
    if p.pid is not None:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it exited meanwhile


def _drive(
    cfg: HistoryConfig,
    res: HistoryResult,
    procs: dict[str, BaseProcess],
    incs: dict[str, int],
    start: Any,
    counter: _Counter,
    rng: random.Random,
    nlog: EventLog,
    t0: float,
    planned: Any = None,
) -> None:
    """The running phase: poll progress, restart dead actors, kill -9 victims.
    ``planned(process)``: whether an actor's death was its own planned kill."""
    next_crash = time.monotonic() + rng.expovariate(1.0 / cfg.crash_mean_interval_s)
    deadline = t0 + cfg.time_limit_s
    while counter.poll() < cfg.target_ops and time.monotonic() < deadline:
        time.sleep(0.1)
        now = time.monotonic()
        for name, p in list(procs.items()):
            if not p.is_alive():
                if planned is not None and planned(p):
                    res.planned_kills += 1
                else:
                    res.restarts_unexpected += 1
                nlog.note("actor_died", victim=name, inc=incs[name], exitcode=p.exitcode)
                start(name)
        if res.restarts_unexpected > 5:
            break
        if res.crashes < cfg.max_crashes and now >= next_crash:
            victim = rng.choice(sorted(procs))
            p = procs[victim]
            if p.is_alive():
                _kill(p)
                p.join(5)
                res.crashes += 1
                nlog.note("crash", victim=victim, inc=incs[victim])
                start(victim)
            next_crash = now + rng.expovariate(1.0 / cfg.crash_mean_interval_s)
