"""The writer actor of a history: compare-and-append, definite appends, long writes.

Writers write unique, traceable records (the key of every inserted record is
``{op id}/{i}``; the definite stream's are ``d/{t}/{j}``), compare-and-append with good
and stale bounds, and run *long writes* (a batch built part by part with pauses,
through the handle's builder or Spark-style under a registered part writer) and, at
``verified_append_rate``, divergent verified appends (``divergent``).
"""

from __future__ import annotations

import time
from typing import Any

from persist_lib.errors import LeaseExpired, PersistError
from persist_lib.testing.actor_base import Actor
from persist_lib.testing.history import FAIL, OK
from persist_lib.testing.history_config import (
    KEY_SCHEMA,
    VAL_SCHEMA,
    HistoryConfig,
    Update,
    definite_updates,
)


class Writer(Actor):
    def __init__(self, cfg: HistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self.w: Any = None
        self.acked: list[tuple[str, int]] = []  # inserted records we may retract

    def open(self) -> None:
        while self.w is None and not self.stopped():

            def do() -> dict[str, Any]:
                self.w = self.client.open_writer(
                    self.shard, KEY_SCHEMA, VAL_SCHEMA, purpose=f"{self.actor}.{self.inc}"
                )
                self.faulty_heartbeats(self.w)
                return {"writer_id": self.w.writer_id}

            outcome, _, _ = self.run_op("open_writer", {}, do)
            if outcome != OK:
                self.w = None
                self.sleep(0.05, 0.2)

    def step(self) -> None:
        if self.w is None:
            self.open()
            return
        w = self.w
        try:
            upper_t = (w.fetch_recent_upper() if self.rng.random() < 0.5 else w.upper).time
        except PersistError:
            self.sleep(0.01, 0.05)
            return
        if upper_t is None:
            return
        r = self.rng.random()
        if self.rng.random() < self.cfg.long_write_rate:
            self.long_write(upper_t)
        elif self.cfg.verified_append_rate > 0 and self.rng.random() < self.cfg.verified_append_rate:
            self.verified_append()
        elif r < 0.55:
            self.caa(upper_t, stale=False)
        elif r < 0.62:
            self.caa(upper_t, stale=True)
        elif r < 0.95:
            self.definite_append(upper_t)
        else:
            _, _, e = self.run_op("writer_heartbeat", {"writer_id": w.writer_id}, w.heartbeat)
            self.after(e)
        self.sleep(0.0, 0.03)

    def caa(self, upper_t: int, *, stale: bool) -> None:
        w = self.w
        if stale:
            if upper_t == 0:
                return
            expected = max(0, upper_t - self.rng.randint(1, 3))
            new = expected + 1
        else:
            expected = upper_t
            new = expected + self.rng.randint(1, 3)
        oid = self.log.new_op_id()
        ups: list[Update] = []
        for i in range(self.rng.choice([0, 1, 1, 2, 3, 4])):
            ups.append(((((f"{oid}/{i}",), (self.rng.randint(0, 999),))), self.rng.randrange(expected, new), 1))
        retracted: tuple[str, int] | None = None
        if self.acked and self.rng.random() < 0.3:
            retracted = self.acked.pop(self.rng.randrange(len(self.acked)))
            ups.append((((retracted[0],), (retracted[1],)), self.rng.randrange(expected, new), -1))
        args = {
            "writer_id": w.writer_id,
            "expected": expected,
            "new": new,
            "stale": stale,
            "updates": [[u[0][0][0], u[0][1][0], u[1], u[2]] for u in ups],
        }
        def do_caa() -> dict[str, Any]:
            w.compare_and_append(ups, expected, new)
            return {"seqno": w.last_commit_seqno}

        outcome, _, e = self.run_op("caa", args, do_caa, op_id=oid)
        if outcome == OK:
            self.acked += [(u[0][0][0], u[0][1][0]) for u in ups if u[2] > 0]
        elif outcome == FAIL and retracted is not None:
            self.acked.append(retracted)  # definitely not retracted: may retract later
        self.after(e)

    def long_write(self, upper_t: int) -> None:
        """A batch built slowly, part by part, then committed with one CAS: through the
        handle's own builder, or Spark-style (parts under a separately registered part
        writer, released by the commit). Sweeps with a clock hours ahead run meanwhile."""
        from persist_lib.shard.batch_builder import BatchBuilder
        from persist_lib.shard.part_writers import PartWriter

        w = self.w
        expected, new = upper_t, upper_t + self.rng.randint(1, 3)
        oid = self.log.new_op_id()
        ups: list[Update] = [
            ((((f"{oid}/{i}",), (self.rng.randint(0, 999),))), self.rng.randrange(expected, new), 1)
            for i in range(self.rng.randint(1, 6))
        ]
        spark_style = self.rng.random() < 0.5
        pauses = [self.rng.uniform(*self.cfg.long_write_pause_s) for _ in range(len(ups) + 1)]
        args = {
            "writer_id": w.writer_id,
            "expected": expected,
            "new": new,
            "stale": False,
            "long": "spark" if spark_style else "builder",
            "updates": [[u[0][0][0], u[0][1][0], u[1], u[2]] for u in ups],
        }

        def do() -> dict[str, Any]:
            pw = None
            if spark_style:
                pw = PartWriter.register(
                    self.client.machine(self.shard), purpose="spark-style", context=self.client
                )
            b = BatchBuilder(
                self.client.blob, w.schemas, shard=w.shard_id,
                writer=pw.writer_id if pw is not None else w.writer_id,
                lower=_frontier(expected), target_part_bytes=1, max_inflight_uploads=1,
                inline_threshold=0, executor=self.client.upload_executor(),
            )
            try:
                for u, pause in zip(ups, pauses, strict=False):
                    b.add(w.normalize([u]))  # a part per update (target 1 byte)
                    time.sleep(pause)
                batch = b.finish(new)
            except Exception:
                if pw is not None:
                    pw.release()
                raise
            time.sleep(pauses[-1])
            w.compare_and_append_batch(
                batch, expected, new, release_part_writer=pw.writer_id if pw is not None else None
            )
            if pw is not None:
                pw.release()
            return {"seqno": w.last_commit_seqno}

        outcome, _, e = self.run_op("caa", args, do, op_id=oid)
        if outcome == OK:
            self.acked += [(u[0][0][0], u[0][1][0]) for u in ups]
        self.after(e)

    def after_interrupt(self) -> None:
        if self.rng.random() < 0.3:
            self.w = None  # the program abandons the handle (its lease lapses)

    def definite_append(self, upper_t: int) -> None:
        w = self.w
        lo = max(0, upper_t - self.rng.randint(0, 2))
        hi = max(lo + 1, upper_t) + self.rng.randint(0, 3)
        ups = definite_updates(self.cfg.seed, lo, hi)
        args = {"writer_id": w.writer_id, "lower": lo, "upper": hi, "n": len(ups)}
        def do_append() -> dict[str, Any]:
            w.append(ups, lo, hi)
            return {"seqno": w.last_commit_seqno, "skipped": w.last_append_skipped}

        _, _, e = self.run_op("append", args, do_append)
        self.after(e)

    def verified_append(self) -> None:
        """A divergent verified append (``testing.divergent``): it must never return."""
        from persist_lib.testing.divergent import divergent_verified_append

        divergent_verified_append(self)

    def after(self, e: BaseException | None) -> None:
        # A lapsed lease (expired after an outage or a stall) needs a new handle.
        if isinstance(e, LeaseExpired):
            self.w = None

    def shutdown(self) -> None:
        if self.w is not None:
            w = self.w
            self.run_op("expire_writer", {"writer_id": w.writer_id}, w.expire)


def _frontier(t: int) -> Any:
    from persist_lib.frontier import Antichain

    return Antichain([t])
