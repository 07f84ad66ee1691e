"""STORAGE: named collections made of renditions made of persist shards.

``StorageController(client)`` is the entry point; see ``controller.py``.
"""

from persist_lib.storage.controller import StorageController, UnknownCollection
from persist_lib.storage.reader import CollectionDeleted, CollectionListen, CollectionReader
from persist_lib.storage.writer import CollectionWriter

__all__ = [
    "CollectionDeleted",
    "CollectionListen",
    "CollectionReader",
    "CollectionWriter",
    "StorageController",
    "UnknownCollection",
]
