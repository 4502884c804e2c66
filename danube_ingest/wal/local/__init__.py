"""The file backend of the region WAL: segment files on the local disk.

``writer`` holds the backend (the writer thread, group commit, fdatasync, seals); ``files``
the segment files' creation ahead, block reservation and removal. The file format is stated in
:mod:`danube_ingest.wal.framing` and :mod:`danube_ingest.wal.segment`; recovery, verify and
repair of these files in :mod:`danube_ingest.wal.recovery`.
"""

from danube_ingest.wal.local.writer import FileBackend

__all__ = ["FileBackend"]
