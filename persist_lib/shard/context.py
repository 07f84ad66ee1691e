"""The shard context: what the shard machinery needs from whoever runs it.

The compactor, the part writers and the maintenance runs need a location (blob and
consensus), a configuration, metrics, a machine per shard and someone to heartbeat
the leases they take. ``PersistClient`` (the public handles' layer) provides all of
it, but the machinery must not depend on the client that hands out the public
handles: it would make the shard package import the layer above it (in Materialize,
too, the internal machinery holds a ``Machine`` and never the client). So the
machinery takes a ``ShardContext``, a protocol the client satisfies as it is, and the
public API that takes a client passes the client down as that context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.config import PersistConfig
    from persist_lib.ids import ShardId
    from persist_lib.location.base import Blob, Consensus
    from persist_lib.shard.machine import Machine
    from persist_lib.shard.metrics import PersistMetrics


class Lease(Protocol):
    """Something holding a lease on a shard that must be heartbeaten (a handle, a
    ``PartWriter``): ``heartbeat()`` renews it, raising ``LeaseExpired`` once it is gone.
    A lease with its own duration says so in a ``lease_ms`` attribute; a handle's is the
    configuration's reader or writer lease."""

    last_heartbeat_monotonic: float

    def heartbeat(self) -> None: ...


class ShardContext(Protocol):
    """A location opened with a configuration: shard machines, and a heartbeat for leases."""

    @property
    def config(self) -> PersistConfig: ...

    @property
    def blob(self) -> Blob: ...

    @property
    def consensus(self) -> Consensus: ...

    @property
    def metrics(self) -> PersistMetrics | None: ...

    def machine(self, shard: ShardId | str) -> Machine:
        """The (cached) machine of ``shard``, whose state every handle of the context shares."""
        ...

    def track_lease(self, lease: Lease) -> None:
        """Heartbeats ``lease`` every ``lease_ms / 4`` until ``forget_lease`` (or until its
        heartbeat raises ``LeaseExpired``)."""
        ...

    def forget_lease(self, lease: Lease) -> None:
        """Stops heartbeating ``lease`` (it was released)."""
        ...
