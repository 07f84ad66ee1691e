"""What a read or write handle needs from the client that opened it.

A handle holds its shard's ``Machine`` and this context, never the ``PersistClient``
class itself: the client imports the handles to build them, so a handle importing the
client would close a circle (Materialize's handles, too, hold a machine and the
location, not the client). ``PersistClient`` satisfies the protocol as it is.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from persist_lib.shard.context import ShardContext


class HandleContext(ShardContext, Protocol):
    """A ``ShardContext`` that also names its blob location (splits carry it to other
    processes) and lends its long-lived pool for part encodes and uploads."""

    @property
    def blob_uri(self) -> str: ...

    def upload_executor(self) -> ThreadPoolExecutor:
        """The pool part encodes and uploads run on (one per client)."""
        ...
