"""The public API of danube_ingest.metadata."""

from __future__ import annotations

import danube_ingest.metadata as metadata
from danube_ingest.errors import DanubeIngestError


def test_everything_exported_exists() -> None:
    for name in metadata.__all__:
        assert getattr(metadata, name) is not None, name


def test_errors_share_one_root_and_say_whether_to_retry() -> None:
    assert issubclass(metadata.MetadataError, DanubeIngestError)
    assert metadata.MetadataUnavailableError.retriable
    assert not metadata.CommitStateUnknownError.retriable
    assert not metadata.FencedError.retriable
