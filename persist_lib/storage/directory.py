"""What collection readers and writers ask of the controller that opened them.

``CollectionReader`` and ``CollectionWriter`` call back into their
``StorageController`` (does the collection still exist, open the readers of a
rendition, which rendition is active). They see it only through these protocols, so
``reader.py`` and ``writer.py`` sit below ``controller.py`` and never import it.
"""

from __future__ import annotations

from typing import Protocol

from persist_lib.frontier import Antichain
from persist_lib.handles.read import ReadHandle
from persist_lib.txn.txns import Txns


class RenditionDirectory(Protocol):
    """The controller as a collection reader sees it."""

    def _collection_exists(self, name: str) -> bool: ...

    def _open_rendition_readers(self, name: str, rendition: str) -> list[ReadHandle]: ...

    def _txn_prepare_read(self, name: str, shard_ids: list[str]) -> None: ...


class ActiveRendition(Protocol):
    """The controller as a collection writer sees it."""

    def _active_rendition_at_upper(self, name: str) -> str: ...

    def _note_active(self, name: str, upper: Antichain, rendition: str) -> None: ...

    def _txns_if_transactional(self, name: str) -> Txns | None:
        """The location's ``Txns`` if collection ``name`` is transactional (now), else None."""
        ...
