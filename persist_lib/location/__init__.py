"""Location: the Blob and Consensus contracts, their backends, URIs and fault injection.

``open_blob(uri)`` / ``open_consensus(uri)`` pick a backend from a URI (see
``persist_lib.location.uri``); ``RetryingBlob`` / ``RetryingConsensus`` add retries with
backoff, ``UnreliableBlob`` / ``UnreliableConsensus`` inject faults. ``S3Blob`` and
``PostgresConsensus`` are imported lazily (boto3 and psycopg are slow to import).
"""

from typing import TYPE_CHECKING, Any

from persist_lib.location.base import (
    Blob,
    BlobMetadata,
    CaSResult,
    Consensus,
    VersionedData,
)
from persist_lib.location.file_blob import FileBlob, validate_key
from persist_lib.location.mem import MemBlob, MemConsensus
from persist_lib.location.retry import (
    RetryingBlob,
    RetryingConsensus,
    RetryPolicy,
    retry_external,
)
from persist_lib.location.sqlite_consensus import SqliteConsensus
from persist_lib.location.unreliable import (
    FaultRates,
    UnreliableBlob,
    UnreliableConsensus,
    UnreliableHandle,
)
from persist_lib.location.uri import (
    SensitiveUrl,
    default_uris,
    open_blob,
    open_consensus,
    redact,
)

if TYPE_CHECKING:  # pragma: no cover
    from persist_lib.location.postgres_consensus import PostgresConsensus
    from persist_lib.location.s3_blob import S3Blob

__all__ = [
    "Blob",
    "BlobMetadata",
    "CaSResult",
    "Consensus",
    "FaultRates",
    "FileBlob",
    "MemBlob",
    "MemConsensus",
    "PostgresConsensus",
    "RetryPolicy",
    "RetryingBlob",
    "RetryingConsensus",
    "S3Blob",
    "SensitiveUrl",
    "SqliteConsensus",
    "UnreliableBlob",
    "UnreliableConsensus",
    "UnreliableHandle",
    "VersionedData",
    "default_uris",
    "open_blob",
    "open_consensus",
    "redact",
    "retry_external",
    "validate_key",
]


def __getattr__(name: str) -> Any:
    if name == "S3Blob":
        from persist_lib.location.s3_blob import S3Blob

        return S3Blob
    if name == "PostgresConsensus":
        from persist_lib.location.postgres_consensus import PostgresConsensus

        return PostgresConsensus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
