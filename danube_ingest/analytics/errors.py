"""Exceptions raised by danube_ingest.analytics.

::

    DanubeIngestError
     └── AnalyticsError                 root of this package's errors
          ├── InvalidLayoutError         a width, rendition name or warehouse path that is not
          │                              valid (also a ValueError)
          ├── PartitionDataError         rows that cannot be one partition's file: wrong schema,
          │                              duplicate offsets (also a ValueError)
          ├── CommitFailedError          a partition commit was definitely not applied (its run's
          │                              intent expired, its rendition was collected, or the
          │                              rendition kept changing); retriable says whether a
          │                              fresh run may succeed
          ├── PublishError               a committed file can be neither found nor published
          │                              from its staging copy; names both paths
          └── RenditionError             a rendition cannot be created, activated or collected
               └── RenditionHeldError    a reader holds it: collect later; retriable

A commit whose outcome is unknown (an etcd transaction timed out) surfaces as
``danube_ingest.metadata.CommitStateUnknownError`` only after re-reading the record did not
settle it: re-read (or re-run, which re-reads) before retrying.
"""

from __future__ import annotations

from danube_ingest.errors import DanubeIngestError


class AnalyticsError(DanubeIngestError):
    """Root of the analytics package's errors."""


class InvalidLayoutError(AnalyticsError, ValueError):
    """A table width, rendition name or warehouse path that the layout does not allow."""


class PartitionDataError(AnalyticsError, ValueError):
    """Rows given for one partition that cannot be written as its file. Nothing was written."""


class CommitFailedError(AnalyticsError):
    """A partition commit was definitely not applied; the partition is as it was before.

    ``retriable`` is True when a new run may commit it (the rendition changed too often), False
    when retrying this run cannot help (its intent expired, the rendition was collected).
    """

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class PublishError(AnalyticsError):
    """A committed file is missing from its final path and its staging copy is gone or does not
    match its recorded size and CRC. The partition must be reconverted into a new rendition."""


class RenditionError(AnalyticsError):
    """A rendition that cannot be created, activated or collected as asked."""


class RenditionHeldError(RenditionError):
    """A reader holds the rendition, so it is not collected. Retry after the hold is released
    (holds live under leases, so a dead reader's hold expires)."""

    retriable = True
