"""The reader actor of a history: snapshots, splits, listens and since downgrades.

Readers take snapshots (whole and split), keep one listen at a time, downgrade their
since, and try backward downgrades that must fail.
"""

from __future__ import annotations

import time
from typing import Any

from persist_lib.errors import BlobNotFound, LeaseExpired, PersistError
from persist_lib.testing.actor_base import Actor
from persist_lib.testing.history import OK
from persist_lib.testing.history_config import KEY_SCHEMA, VAL_SCHEMA, HistoryConfig


class Reader(Actor):
    def __init__(self, cfg: HistoryConfig, actor: str, incarnation: int) -> None:
        super().__init__(cfg, actor, incarnation)
        self.r: Any = None
        self.listen: Any = None
        self.listen_id: str | None = None

    def open(self) -> None:
        while self.r is None and not self.stopped():
            def do() -> dict[str, Any]:
                self.r = self.client.open_leased_reader(
                    self.shard, KEY_SCHEMA, VAL_SCHEMA, purpose=f"{self.actor}.{self.inc}"
                )
                self.faulty_heartbeats(self.r)
                return {"reader_id": self.r.reader_id}

            outcome, _, _ = self.run_op("open_reader", {}, do)
            if outcome != OK:
                self.r = None
                self.sleep(0.05, 0.2)
        self.listen = None

    def step(self) -> None:
        if self.r is None:
            self.open()
            return
        r = self.r
        if self.cfg.since_probe_rate > 0 and self.rng.random() < self.cfg.since_probe_rate:
            e = self.downgrade() or self.backward_downgrade()
            if isinstance(e, LeaseExpired):
                self.r = None
                self.listen = None
            self.sleep(0.0, 0.03)
            return
        x = self.rng.random()
        if x < 0.24:
            e = self.snapshot()
        elif x < 0.30:
            e = self.snapshot_splits()
        elif x < 0.70:
            e = self.listen_step()
        elif x < 0.85:
            e = self.downgrade()
        elif x < 0.90:
            e = self.backward_downgrade()
        else:
            _, _, e = self.run_op("reader_heartbeat", {"reader_id": r.reader_id}, r.heartbeat)
        if isinstance(e, LeaseExpired):
            self.r = None
            self.listen = None
        self.sleep(0.0, 0.03)

    def _since_upper(self) -> tuple[int, int]:
        r = self.r
        s = r.since.time
        u = r.upper.time
        return (s if s is not None else 0), (u if u is not None else 0)

    def snapshot(self) -> BaseException | None:
        r = self.r
        try:
            since, upper = self._since_upper()
        except PersistError as err:
            return err
        as_of = self.rng.randint(since, upper - 1) if upper - 1 >= since else since

        def do() -> Any:
            t = r.snapshot(as_of, timeout_s=1.0)
            cols = t.to_pydict()
            return [list(x) for x in zip(cols["k"], cols["v"], cols["ts"], cols["diff"], strict=True)]

        _, _, e = self.run_op("snapshot", {"reader_id": r.reader_id, "as_of": as_of}, do)
        return e

    def snapshot_splits(self) -> BaseException | None:
        """Splits (as Spark executors get them) fetched after a pause: the read handle's
        seqno hold must keep their parts alive meanwhile."""
        r = self.r
        try:
            since, upper = self._since_upper()
        except PersistError as err:
            return err
        as_of = self.rng.randint(since, upper - 1) if upper - 1 >= since else since
        n = self.rng.randint(1, 3)
        pause = self.rng.uniform(0.05, 0.6)

        def do() -> Any:
            splits = r.snapshot_splits(as_of, n, timeout_s=1.0)
            try:
                time.sleep(pause)
                out: list[list[Any]] = []
                for sp in splits:
                    try:
                        t = sp.fetch(self.client.blob)
                    except BlobNotFound:
                        r._me(r._machine.fetch_latest())  # LeaseExpired if the lease lapsed
                        raise
                    c = t.to_pydict()
                    out += [list(x) for x in zip(c["k"], c["v"], c["ts"], c["diff"], strict=True)]
                return out
            finally:
                r.release_splits()

        _, _, e = self.run_op(
            "snapshot_splits", {"reader_id": r.reader_id, "as_of": as_of, "splits": n, "pause_s": pause}, do
        )
        return e

    def listen_step(self) -> BaseException | None:
        r = self.r
        if self.listen is None or self.rng.random() < 0.03:
            try:
                since, upper = self._since_upper()
            except PersistError as err:
                return err
            as_of = self.rng.randint(since, max(since, upper))
            lid = self.log.new_op_id()

            def do_open() -> Any:
                self.listen = r.listen(as_of)
                return {"listen_id": lid}

            outcome, _, e = self.run_op(
                "listen_open", {"reader_id": r.reader_id, "as_of": as_of, "listen_id": lid}, do_open, op_id=lid
            )
            if outcome != OK:
                self.listen = None
                return e
            self.listen_id = lid
            return None
        lst = self.listen
        frontier = lst.frontier.time

        def do() -> Any:
            from persist_lib.handles.listen import ListenUpdates

            out = []
            for ev in lst.next(timeout_s=0.2):
                if isinstance(ev, ListenUpdates):
                    c = ev.table.to_pydict()
                    out.append(
                        {
                            "kind": "updates",
                            "lower": ev.lower.time,
                            "upper": ev.upper.time,
                            "rows": [list(x) for x in zip(c["k"], c["v"], c["ts"], c["diff"], strict=True)],
                        }
                    )
                else:
                    out.append({"kind": "progress", "upper": ev.upper.time})
            return out

        outcome, _, e = self.run_op(
            "listen_next",
            {"reader_id": r.reader_id, "listen_id": self.listen_id, "as_of": lst.as_of, "frontier": frontier},
            do,
        )
        return e

    def downgrade(self) -> BaseException | None:
        r = self.r
        try:
            since, upper = self._since_upper()
        except PersistError as err:
            return err
        cap = upper - 1
        if self.listen is not None and self.listen.frontier.time is not None:
            cap = min(cap, self.listen.frontier.time - 1)  # listen needs times >= frontier intact
        if cap < since:
            return None
        new = self.rng.randint(since, cap)
        _, _, e = self.run_op(
            "downgrade_since", {"reader_id": r.reader_id, "new_since": new}, lambda: r.downgrade_since(new)
        )
        return e

    def backward_downgrade(self) -> BaseException | None:
        r = self.r
        try:
            since, _ = self._since_upper()
        except PersistError as err:
            return err
        if since == 0:
            return None
        new = since - 1
        _, _, e = self.run_op(
            "downgrade_since_backward",
            {"reader_id": r.reader_id, "new_since": new, "since": since},
            lambda: r.downgrade_since(new),
        )
        return e

    def shutdown(self) -> None:
        if self.r is not None:
            r = self.r
            self.run_op("expire_reader", {"reader_id": r.reader_id}, r.expire)
