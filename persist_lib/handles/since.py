"""Critical since handles: a since hold with no lease, fenced by an opaque token.

Unlike a leased ``ReadHandle`` it never expires on its own and reads nothing: it only
keeps compaction from forwarding times past its since until its owner (e.g. the storage
controller) downgrades it with ``compare_and_downgrade_since``.
"""

from __future__ import annotations

from persist_lib.errors import InvalidUsage
from persist_lib.frontier import Antichain, FrontierLike, as_frontier
from persist_lib.shard import state as st
from persist_lib.shard import transitions as tr
from persist_lib.shard.codec import Schemas
from persist_lib.shard.machine import Machine


class SinceHandle:
    """A critical since handle: no lease, never expires, fenced by an opaque token."""

    def __init__(self, machine: Machine, reader_id: str, schemas: Schemas) -> None:
        self._machine = machine
        self.reader_id = reader_id
        self.schemas = schemas

    @property
    def shard_id(self) -> str:
        return self._machine.shard_id

    def _me(self) -> st.CriticalReaderState:
        s = self._machine.fetch_latest()
        r = s.critical_readers.get(self.reader_id)
        if r is None:
            raise InvalidUsage(
                f"shard {self.shard_id}: critical reader {self.reader_id} is not registered"
            )
        return r

    @property
    def since(self) -> Antichain:
        return self._me().since

    @property
    def opaque(self) -> str:
        return self._me().opaque

    def compare_and_downgrade_since(
        self, expected_opaque: str, new_opaque: str, new_since: FrontierLike
    ) -> tr.CriticalDowngradeResult:
        """Downgrades the since iff the recorded opaque is ``expected_opaque``.

        Returns a result with ``ok`` False (and the current opaque) when fenced out.
        """
        since = as_frontier(new_since, "new_since")
        res, _ = self._machine.apply(
            "compare_and_downgrade_since",
            lambda s, now: tr.compare_and_downgrade_since(
                s, now, reader_id=self.reader_id, expected_opaque=expected_opaque,
                new_opaque=new_opaque, new_since=since,
            ),
        )
        return res

    def expire(self) -> None:
        self._machine.apply(
            "expire_critical_reader",
            lambda s, now: tr.expire_critical_reader(s, now, reader_id=self.reader_id),
        )

    def __repr__(self) -> str:
        return f"SinceHandle(shard={self.shard_id}, reader={self.reader_id})"
