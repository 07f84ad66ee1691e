"""Location: the Blob and Consensus contracts, their backends, URIs and fault injection."""

from persist_lib.location.base import (
    Blob,
    BlobMetadata,
    CaSResult,
    Consensus,
    VersionedData,
)

__all__ = ["Blob", "BlobMetadata", "CaSResult", "Consensus", "VersionedData"]
