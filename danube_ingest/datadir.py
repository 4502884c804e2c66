"""A broker's directories: exclusive ownership by one process, and a durable identity.

Guarantees:

* ``DataDirLock.acquire(*dirs)`` holds an exclusive ``flock`` on ``{dir}/LOCK`` for each
  directory (creating the directories), taken before anything else reads or writes them, until
  ``release()`` or until the process ends. The kernel drops the lock however the process ends
  (SIGKILL included), so a crash never leaves a stale lock behind and no clean-up is needed.
* A second process on the same directory (or a second ``acquire`` in the same process) fails at
  once with ``DataDirLockedError`` naming the holder's pid and host, which the holder writes into
  ``LOCK``; it never waits and never touches the directory.
* While a process holds the lock, no other process on this host is serving from the directory:
  that is what lets a restarted broker take back its own etcd registration at once (see
  ``data_dir_id``). ``flock`` is per host: the directory must be on a local disk, not shared
  between machines.
* ``data_dir_id(dir)`` is a random id stored in ``{dir}/ID``, created durably on first use and
  the same for the directory's whole life: it tells "this broker on this data" apart from
  "another machine (or a wiped directory) under the same broker id".
* ``check_metadata_store(dir, identity)`` records on first use which metadata store the
  directory belongs to (``{dir}/METADATA``: etcd's cluster id and the key prefix, or
  ``memory``) and from then on refuses any other with ``MetadataStoreMismatchError`` naming
  both, before the broker reads or writes anything of it there: the WAL's offsets and the
  objects under the directory mean something only to the metadata store that saw them made.

The lock file descriptor is not inherited by child processes (Python opens files
non-inheritable), so children such as ``danube-ingest dev``'s etcd never keep the lock alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import uuid
from pathlib import Path
from types import TracebackType
from typing import Self

from danube_ingest.errors import DataDirLockedError, MetadataStoreMismatchError, StorageError

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
ID_NAME = "ID"
METADATA_NAME = "METADATA"


def _holder(fd: int) -> str:
    """What the lock file says about its holder, e.g. ``pid 1234 on host-a``."""
    with contextlib.suppress(OSError):
        fields = dict(
            part.split("=", 1)
            for part in os.pread(fd, 256, 0).decode(errors="replace").split()
            if "=" in part
        )
        if "pid" in fields:
            return f"pid {fields['pid']} on {fields.get('host', '?')}"
    return "a process that has not written its pid yet"


class DataDirLock:
    """Exclusive locks on one or more directories, held until ``release()`` or process exit."""

    def __init__(self, fds: dict[Path, int]) -> None:
        self._fds = fds

    @classmethod
    def acquire(cls, *dirs: Path | str) -> DataDirLock:
        """Lock every directory in ``dirs`` (created if missing), all or none.

        Raises ``DataDirLockedError`` (naming the holder's pid) if another holder has one of
        them, ``StorageError`` if a directory or its lock file cannot be created.
        """
        fds: dict[Path, int] = {}
        try:
            for name in dirs:
                directory = Path(name).resolve()
                if directory in fds:
                    continue
                fds[directory] = cls._lock_one(directory)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(fds)

    @staticmethod
    def _lock_one(directory: Path) -> int:
        path = directory / LOCK_NAME
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # No O_TRUNC: a process that fails to get the lock must not erase the holder's pid.
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create the lock file {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise StorageError(f"cannot lock {path}: {exc}") from exc
            raise DataDirLockedError(
                f"data directory {directory} is in use by {holder} (lock {path}): stop that "
                "process first, or give this one another --data-dir",
                path=path,
                holder=holder,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        log.info("data directory locked dir=%s pid=%s", directory, os.getpid())
        return fd

    @property
    def dirs(self) -> list[Path]:
        """The directories held (resolved), empty after ``release``."""
        return list(self._fds)

    def holds(self, directory: Path | str) -> bool:
        """Whether this lock holds ``directory``."""
        return Path(directory).resolve() in self._fds

    def release(self) -> None:
        """Give every directory up. Idempotent. (Process exit does the same.)"""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def data_dir_id(directory: Path | str) -> str:
    """The directory's identity (32 hex digits), created durably on first call.

    Call it only while holding the directory's ``DataDirLock``: two processes creating it at
    once could each see their own id.
    """
    directory = Path(directory)
    path = directory / ID_NAME
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    except OSError as exc:
        raise StorageError(f"cannot read the data directory id {path}: {exc}") from exc
    if existing:
        return existing
    new = uuid.uuid4().hex
    try:
        _write_durably(path, new + "\n")
    except OSError as exc:
        raise StorageError(f"cannot write the data directory id {path}: {exc}") from exc
    return new


def check_metadata_store(directory: Path | str, identity: str) -> None:
    """Check that ``directory`` belongs to the metadata store ``identity`` (e.g. ``etcd cluster
    <id> prefix /danube`` or ``memory``), recording it durably when the directory has none yet
    (first use, or a directory from a version that did not record it).

    Raises ``MetadataStoreMismatchError`` naming both stores and what to do when the directory
    was recorded with another one; the directory is left as it was. Call it only while
    holding the directory's ``DataDirLock``.
    """
    directory = Path(directory)
    path = directory / METADATA_NAME
    try:
        recorded = path.read_text().strip()
    except FileNotFoundError:
        recorded = ""
    except OSError as exc:
        raise StorageError(
            f"cannot read the data directory's metadata store {path}: {exc}"
        ) from exc
    if recorded == identity:
        return
    if recorded:
        raise MetadataStoreMismatchError(
            f"data directory {directory} belongs to metadata store {recorded!r} ({path}), but "
            f"this broker is configured with {identity!r}: its WAL offsets and objects mean "
            "nothing to another store (offsets would start again, objects would go where that "
            "store never looks). Start it with the store it was made with (--etcd, "
            "etcd.prefix), or give it a data directory of its own (--data-dir)",
            path=path,
            recorded=recorded,
            configured=identity,
        )
    try:
        _write_durably(path, identity + "\n")
    except OSError as exc:
        raise StorageError(
            f"cannot record the data directory's metadata store {path}: {exc}"
        ) from exc
    log.info("data directory metadata store recorded dir=%s store=%r", directory, identity)


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably (temp file, fsync, rename, directory
    fsync): after a crash it holds either its old content or ``text``."""
    temp = path.with_name(f"{path.name}.tmp")
    with temp.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
