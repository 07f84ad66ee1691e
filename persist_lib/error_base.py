"""The two roots of persist's error taxonomy: ``PersistError`` and ``InvalidUsage``.

They live below both ``frontier`` (whose time checks raise ``InvalidUsage``) and
``errors`` (whose ``UpperMismatch`` carries frontiers), so neither of those imports the
other in a circle. Import them from ``persist_lib.errors``, where the whole taxonomy is
listed; only ``frontier`` imports this module directly.
"""

from __future__ import annotations


class PersistError(Exception):
    """Base class of every error raised by persist_lib."""


class InvalidUsage(PersistError, ValueError):
    """The call can never succeed as made: fix the call (or reopen the handle)."""
