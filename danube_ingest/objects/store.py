"""``ObjectStore``: the one way the daemon, Dagster and Spark reach object storage (opendal).

Keys are ``/``-separated paths relative to the store's root (``segments/b1/0/00…01.bin``); they
never start or end with ``/``. Backends: ``fs``, ``memory``, ``s3``, ``gcs`` (any opendal scheme
works through ``ObjectStore(scheme, options=...)``).

Guarantees, on every backend unless said otherwise:

- ``put`` replaces the whole object. On s3, gcs and memory readers see the old or the new bytes,
  never a mix; on fs a reader racing a ``put`` (or a crash during one) can see a short file,
  which the next ``put`` of the key replaces.
- ``put_if_absent`` writes only when no object exists under the key; of concurrent calls exactly
  one wins. ``False`` means "an object is there" — possibly written by this very call: when an
  attempt succeeds but its answer is lost, the retry finds the object and reports ``False``.
  Callers that care must read it back and compare (the uploader does).
- ``get_range`` returns exactly ``size`` bytes; a range not wholly inside the object is a
  non-retriable ``ObjectStoreError``.
- ``list(prefix)`` returns the keys of objects (never directories) that start with ``prefix``
  as a string, recursively, sorted. In-flight ``put_large`` uploads live under ``_staging/`` and
  show up when listing that prefix (or ``""``).
- ``delete`` is idempotent.
- ``put_large`` never leaves a partial object under the final key (see below).
- fs with ``min_free_bytes``: ``put`` and ``put_if_absent`` refuse, before writing, an object
  that would leave less than that many bytes free on the root's filesystem (counting other puts
  in flight), with a retriable ``ObjectStoreError``; a write that fails anyway (ENOSPC) has its
  partial file removed, so retrying never fills the disk (see :mod:`danube_ingest.wal.space`).

Retries: every call retries transient failures with exponential backoff and *equal jitter*
(retry n waits ``d/2 + uniform(0, d/2)`` with ``d = min(max_delay, base_delay * 2**n)``): the
half that is kept makes ``max_retries`` cover a predictable minimum outage window, the random
half keeps brokers that failed together from retrying together. Each retry is counted in
``stats.retries``; after ``max_retries`` the last error is raised as a retriable
``ObjectStoreError``. Each request is bounded by ``timeout`` seconds (opendal's TimeoutLayer) so
a stalled connection becomes a retriable error instead of a hang.

How opendal 0.47 errors are classified::

    NotFound                                    ObjectNotFoundError (never retried)
    Unexpected (temporary)                      retried: connection refused/reset, timeouts, 5xx
    Unexpected (permanent)                      fatal: e.g. a short ranged read on s3
    RateLimited, Conflict, Error                retried (throttling, concurrent-modification 409)
    ConfigInvalid                               fatal: bad options, and a missing s3 bucket
                                                (NoSuchBucket); HEAD has no body, so ``size`` on a
                                                missing bucket sees NotFound and returns None
    PermissionDenied, Unsupported, IsADirectory,
    NotADirectory, AlreadyExists, IsSameFile,
    RangeNotSatisfied                           fatal
    ConditionNotMatch                           put_if_absent: False (not an error); else fatal

Messages name the operation, the key and ``description`` (bucket, root, endpoint — never
credentials; option values that look secret are also scrubbed from opendal's text).

``put_large``: opendal's streaming writer has no abort — if the writer is closed after a failure
(or its ``with`` block raises) the partial object is committed under its key. So it streams to
``_staging/{uuid}-{basename}``, then moves the finished object to the final key: ``rename`` where
the backend has it (fs: atomic), else a server-side ``copy`` (s3, gcs; S3's CopyObject is limited
to 5 GiB per object), else read + write (memory). The staging key is deleted afterwards and on
every failure. A process that dies mid-upload leaves a ``_staging/`` object (and on S3 maybe an
incomplete multipart upload: give the bucket an AbortIncompleteMultipartUpload lifecycle rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import opendal
from opendal import exceptions as od
from opendal.layers import TimeoutLayer

from danube_ingest.config import BrokerConfig, UploaderConfig
from danube_ingest.errors import ConfigError, ObjectNotFoundError, ObjectStoreError
from danube_ingest.observability.metrics import OBJECT_WRITE_SECONDS
from danube_ingest.wal.meta import fsync_dir
from danube_ingest.wal.space import DiskFree, disk_free

__all__ = ["STAGING_PREFIX", "ObjectInfo", "ObjectStore", "RetryPolicy", "StoreStats"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Where ``put_large`` streams objects before moving them to their final key.
STAGING_PREFIX = "_staging/"

#: opendal exceptions that are worth another attempt, whatever their message says: throttling
#: (429, SlowDown) and S3's 409s for concurrent operations on one key, which say "retry".
_RETRIABLE = (od.RateLimited, od.Conflict)
#: opendal exceptions whose own status ("temporary"/"permanent") decides.
_BY_STATUS = (od.Unexpected, od.Error)
#: Every exception opendal raises (they share no base class besides Exception).
_OPENDAL_ERRORS: tuple[type[Exception], ...] = (
    od.Error,
    od.Unexpected,
    od.Unsupported,
    od.ConfigInvalid,
    od.NotFound,
    od.PermissionDenied,
    od.IsADirectory,
    od.NotADirectory,
    od.AlreadyExists,
    od.IsSameFile,
    od.ConditionNotMatch,
    od.RateLimited,
    od.RangeNotSatisfied,
    od.Conflict,
)

#: Words that mark an option name as a credential: its value is scrubbed from every error
#: message, and such options are refused where options travel to other processes (Spark tasks).
CREDENTIAL_WORDS = (
    "secret",
    "token",
    "password",
    "credential",
    "access_key",
    "account_key",
    "private_key",
)


def is_credential_option(name: str) -> bool:
    """Whether an opendal option ``name`` names a credential (see ``CREDENTIAL_WORDS``)."""
    lowered = name.lower()
    return any(word in lowered for word in CREDENTIAL_WORDS)


#: opendal's message is many lines (context, HTTP headers, a backtrace); the first line and the
#: root cause are what an operator needs, capped so one error is one readable log line.
_MAX_DETAIL = 600


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with equal jitter (see the module docstring)."""

    max_retries: int = 10
    """Retries after the first attempt; 0 makes every failure final at once."""
    base_delay: float = 0.1
    """Nominal delay before the first retry, in seconds; doubles on each further retry."""
    max_delay: float = 10.0
    """Cap of the nominal delay, in seconds."""

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 (got {self.max_retries})")
        if self.base_delay <= 0:
            raise ValueError(f"base_delay must be > 0 (got {self.base_delay})")
        if self.max_delay < self.base_delay:
            raise ValueError(f"max_delay must be >= base_delay (got {self.max_delay})")

    @classmethod
    def from_config(cls, uploader: UploaderConfig) -> RetryPolicy:
        """The policy of ``storage.uploader`` (max_retries, retry_base_ms, retry_max_ms)."""
        return cls(
            max_retries=uploader.max_retries,
            base_delay=uploader.retry_base_ms / 1000,
            max_delay=uploader.retry_max_ms / 1000,
        )

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first retry):
        between half and all of ``min(max_delay, base_delay * 2**retry)``."""
        nominal = min(self.max_delay, self.base_delay * 2.0 ** min(retry, 64))
        return nominal / 2 + random.uniform(0, nominal / 2)


@dataclass(slots=True)
class StoreStats:
    """Counters since the store was created. One count per call, whatever its retries."""

    puts: int = 0
    """``put``, ``put_if_absent`` and ``put_large`` calls."""
    gets: int = 0
    """``get`` and ``get_range`` calls."""
    deletes: int = 0
    lists: int = 0
    stats: int = 0
    """``size`` and ``stat`` calls."""
    retries: int = 0
    """Attempts repeated after a transient failure (internal steps of ``put_large`` included)."""
    bytes_written: int = 0
    """Bytes of successful puts."""
    bytes_read: int = 0
    """Bytes returned by successful gets."""
    failures: int = 0
    """Calls that raised ``ObjectStoreError`` (not counting ``ObjectNotFoundError``)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What ``stat`` knows of one object."""

    size: int
    """Size in bytes."""
    modified_ms: int | None
    """Last modification, Unix milliseconds; None where the backend keeps no time (memory)."""


def location_options(config: BrokerConfig) -> dict[str, str]:
    """opendal's options naming where ``storage.cloud`` (fs, s3 or gcs) keeps its objects: root,
    bucket, endpoint, region. No credentials, and not ``storage.cloud.options``."""
    cloud = config.storage.cloud
    if cloud.backend == "fs":
        return {"root": config.objects_root()}
    assert cloud.bucket is not None  # CloudConfig requires it for s3 and gcs
    options = {"bucket": cloud.bucket}
    if cloud.root:
        options["root"] = cloud.root
    if cloud.endpoint is not None:
        options["endpoint"] = cloud.endpoint
    if cloud.backend == "s3":
        assert cloud.region is not None  # CloudConfig requires it for s3
        options["region"] = cloud.region
    return options


class ObjectStore:
    """Async object storage over one opendal operator; see the module docstring for guarantees.

    ``options`` are opendal's (all strings). ``timeout`` bounds each request in seconds (None: no
    bound); it must exceed the time one PUT of the largest object or part takes.
    """

    def __init__(
        self,
        scheme: str,
        *,
        options: dict[str, str],
        retry: RetryPolicy = RetryPolicy(),
        description: str | None = None,
        timeout: float | None = 60.0,
        min_free_bytes: int = 0,
        free_space: DiskFree = disk_free,
    ) -> None:
        self._scheme = scheme
        self._retry = retry
        self._description = description or _describe(scheme, options)
        #: fs only: the root directory, whose entries are fsync'ed after each write.
        self._fs_root = Path(options["root"]) if scheme == "fs" and options.get("root") else None
        #: fs only: free space each put must leave on the root's filesystem, and bytes of puts
        #: admitted against it but not finished yet.
        self._min_free = min_free_bytes if self._fs_root is not None else 0
        self._free_space = free_space
        self._writing = 0
        self._secrets = tuple(
            value
            for name, value in options.items()
            if len(value) >= 4 and is_credential_option(name)
        )
        try:
            operator = opendal.AsyncOperator(scheme, **options)
        except _OPENDAL_ERRORS as exc:  # unknown scheme, missing bucket/region/root option…
            raise ObjectStoreError(
                f"cannot open object store {self._description}: {_detail(exc, self._secrets)}"
            ) from exc
        if timeout is not None:
            operator = operator.layer(TimeoutLayer(timeout=timeout, io_timeout=timeout))
        self._op: opendal.AsyncOperator | None = operator
        capability = operator.capability()
        self._can_rename = bool(capability.rename)
        self._can_copy = bool(capability.copy)
        self.stats = StoreStats()

    @classmethod
    def from_config(cls, config: BrokerConfig) -> ObjectStore:
        """The store of ``storage.cloud``, retrying per ``storage.uploader``.

        s3 with explicit keys also sets ``disable_config_load`` and ``disable_ec2_metadata``, so
        ``~/.aws`` files, ``AWS_*`` variables and the instance role cannot mix in (a stray
        ``AWS_SESSION_TOKEN`` would break the signature); without keys opendal's default
        credential chain is used. ``storage.cloud.options`` are applied last and win.
        """
        cloud = config.storage.cloud
        policy = RetryPolicy.from_config(config.storage.uploader)
        if cloud.backend == "memory":
            return cls.memory(retry=policy)
        options = location_options(config)
        min_free = 0
        if cloud.backend == "fs":
            # The lower half of the WAL's floor: room to ship segments while publishes wait.
            min_free = config.storage.wal.retention.min_free_bytes // 2
        if cloud.backend == "s3":
            secret = cloud.secret_access_key
            if (cloud.access_key_id is None) != (secret is None):
                raise ConfigError(
                    "storage.cloud: set both access_key_id and secret_access_key, or neither "
                    "(to use the default credential chain)"
                )
            if cloud.access_key_id is not None and secret is not None:
                options["access_key_id"] = cloud.access_key_id
                options["secret_access_key"] = secret.get_secret_value()
                options["disable_config_load"] = "true"
                options["disable_ec2_metadata"] = "true"
        options.update(cloud.options)
        return cls(cloud.backend, options=options, retry=policy, min_free_bytes=min_free)

    @classmethod
    def memory(cls, *, retry: RetryPolicy = RetryPolicy()) -> ObjectStore:
        """An empty in-process store (tests, benchmarks); its contents die with it."""
        return cls("memory", options={}, retry=retry)

    @property
    def description(self) -> str:
        """Where the objects live, e.g. ``s3://bucket/root (endpoint http://…)``; no secrets."""
        return self._description

    @property
    def scheme(self) -> str:
        """The opendal scheme: ``fs``, ``memory``, ``s3``, ``gcs``…"""
        return self._scheme

    def __repr__(self) -> str:
        return f"ObjectStore({self._description})"

    async def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing any object there."""
        _check_key(key)
        self.stats.puts += 1
        op = self._operator("put", key)
        with self._room_for("put", key, len(data)):
            await self._call("put", key, lambda: self._write(op, key, data))
        await self._sync_dirs(key)
        self.stats.bytes_written += len(data)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless an object exists there.

        True: written by this call. False: an object is there (see the module docstring: it may
        be this call's own write whose answer was lost — compare contents if that matters).
        """
        _check_key(key)
        self.stats.puts += 1
        op = self._operator("put_if_absent", key)

        async def attempt() -> bool:
            try:
                await self._write(op, key, data, if_not_exists=True)
            except od.ConditionNotMatch:
                return False
            return True

        with self._room_for("put_if_absent", key, len(data)):
            written = await self._call("put_if_absent", key, attempt)
        if written:
            await self._sync_dirs(key)
            self.stats.bytes_written += len(data)
        return written

    async def get(self, key: str) -> bytes:
        """The whole object; ``ObjectNotFoundError`` if there is none."""
        _check_key(key)
        self.stats.gets += 1
        op = self._operator("get", key)
        data = await self._call("get", key, lambda: op.read(key))
        self.stats.bytes_read += len(data)
        return data

    async def get_range(self, key: str, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes from ``offset``; ``ObjectStoreError`` (not retriable) if the
        range does not lie within the object, ``ObjectNotFoundError`` if there is no object."""
        _check_key(key)
        if offset < 0 or size < 0:
            raise ValueError(f"offset and size must be >= 0 (got {offset}, {size})")
        self.stats.gets += 1
        op = self._operator("get_range", key)
        what = f" [{offset}, {offset + size})"
        data = await self._call(
            "get_range", key, lambda: op.read(key, offset=offset, size=size), what=what
        )
        if len(data) != size:
            self.stats.failures += 1
            raise ObjectStoreError(
                f"get_range {key}{what} on {self._description} failed: "
                f"got {len(data)} bytes, the object ends before the range does"
            )
        self.stats.bytes_read += size
        return data

    async def size(self, key: str) -> int | None:
        """The object's size in bytes, None when there is no object."""
        _check_key(key)
        self.stats.stats += 1
        op = self._operator("size", key)

        async def attempt() -> int | None:
            try:
                metadata = await op.stat(key)
            except od.NotFound:
                return None
            return None if metadata.is_dir else metadata.content_length

        return await self._call("size", key, attempt)

    async def stat(self, key: str) -> ObjectInfo | None:
        """Size and last-modified time of the object, None when there is no object."""
        _check_key(key)
        self.stats.stats += 1
        op = self._operator("stat", key)

        async def attempt() -> ObjectInfo | None:
            try:
                metadata = await op.stat(key)
            except od.NotFound:
                return None
            if metadata.is_dir:
                return None
            modified = metadata.last_modified
            modified_ms = None if modified is None else int(modified.timestamp() * 1000)
            return ObjectInfo(metadata.content_length, modified_ms)

        return await self._call("stat", key, attempt)

    async def delete(self, key: str) -> None:
        """Remove the object; nothing happens when there is none."""
        _check_key(key)
        self.stats.deletes += 1
        op = self._operator("delete", key)
        # fs deletes by stat + unlink: a concurrent delete of the same key between the two
        # surfaces as NotFound. The object is gone either way, which is all delete promises.
        with contextlib.suppress(ObjectNotFoundError):
            await self._call("delete", key, lambda: op.delete(key))

    async def list(self, prefix: str) -> list[str]:
        """Keys of all objects whose key starts with ``prefix``, sorted; no directory entries."""
        if prefix.startswith("/"):
            raise ValueError(f"prefix must be relative to the store's root (got {prefix!r})")
        self.stats.lists += 1
        op = self._operator("list", prefix)

        async def attempt() -> list[str]:
            entries = await op.list(prefix, recursive=True)
            return [entry.path async for entry in entries if not entry.path.endswith("/")]

        keys = await self._call("list", prefix or "(all)", attempt)
        # fs emulates prefix listing over directories and returns them unsorted.
        return sorted(key for key in keys if key.startswith(prefix))

    async def put_large(
        self,
        key: str,
        chunks: Iterable[bytes] | AsyncIterable[bytes],
        *,
        part_bytes: int = 8 << 20,
        size: int | None = None,
    ) -> int:
        """Stream ``chunks`` into one object under ``key`` and return its size.

        ``size``, when the caller knows it, admits the write against ``min_free_bytes`` on fs
        as ``put`` does (refused before writing, retriable).

        The object appears under ``key`` only once complete: if ``chunks`` raises, the upload
        fails or the call is cancelled, nothing is left under ``key`` (an earlier object there
        is untouched) nor under the staging key. ``part_bytes`` is the multipart part size on
        s3/gcs (at least 5 MiB there). The streaming phase is not retried (``chunks`` cannot
        be replayed): retry the call with a fresh iterator when the error is retriable.
        """
        _check_key(key)
        if part_bytes <= 0:
            raise ValueError(f"part_bytes must be > 0 (got {part_bytes})")
        self.stats.puts += 1
        op = self._operator("put_large", key)
        staging = f"{STAGING_PREFIX}{uuid.uuid4().hex}-{key.rsplit('/', 1)[-1]}"
        try:
            room = (
                contextlib.nullcontext() if size is None else self._room_for("put_large", key, size)
            )
            with room:
                written = await self._stream(op, staging, chunks, part_bytes)
            await self._move(op, staging, key)
        except BaseException as exc:
            await self._discard(op, staging, retry=False)
            if isinstance(exc, _OPENDAL_ERRORS):
                self.stats.failures += 1
                raise self._error("put_large", key, exc, attempts=1) from exc
            raise
        await self._discard(op, staging, retry=True)
        self.stats.bytes_written += written
        return written

    async def close(self) -> None:
        """Release the operator; later calls raise ``ObjectStoreError``. Idempotent."""
        self._op = None

    async def _stream(
        self,
        op: opendal.AsyncOperator,
        staging: str,
        chunks: Iterable[bytes] | AsyncIterable[bytes],
        part_bytes: int,
    ) -> int:
        writer = await self._call(
            "put_large", staging, lambda: op.open(staging, "wb", chunk=part_bytes)
        )
        written = 0
        try:
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    written += await writer.write(chunk)
            else:
                for chunk in chunks:
                    written += await writer.write(chunk)
        except BaseException:
            # Closing commits what was written (opendal has no abort) — hence the staging key —
            # and ends an S3 multipart upload rather than leaving it billed and dangling.
            with contextlib.suppress(*_OPENDAL_ERRORS):
                await writer.close()
            raise
        await writer.close()
        return written

    @contextlib.contextmanager
    def _room_for(self, operation: str, key: str, size: int) -> Iterator[None]:
        """fs with ``min_free_bytes``: admit a write of ``size`` bytes only if it leaves that
        much free, counting writes in flight; else a retriable ``ObjectStoreError``."""
        root = self._fs_root
        if root is None or self._min_free <= 0:
            yield
            return
        try:
            free = self._free_space(root)
        except OSError as exc:
            raise ObjectStoreError(
                f"{operation} {key} on {self._description}: free space unknown: {exc}",
                retriable=True,
            ) from exc
        if free - self._writing - size < self._min_free:
            self.stats.failures += 1
            raise ObjectStoreError(
                f"{operation} {key} ({size} bytes) on {self._description} refused: {free} bytes "
                f"free ({self._writing} being written) would leave less than {self._min_free} "
                "(half of storage.wal.retention.min_free_bytes); free space on that filesystem",
                retriable=True,
            )
        self._writing += size
        try:
            yield
        finally:
            self._writing -= size

    async def _write(
        self, op: opendal.AsyncOperator, key: str, data: bytes, *, if_not_exists: bool = False
    ) -> None:
        """One write attempt. On fs a failed write leaves what it wrote in place (opendal
        writes the final file directly): remove it, so a full disk is not kept full by it."""
        started = time.monotonic()
        try:
            if if_not_exists:
                await op.write(key, data, if_not_exists=True)
            else:
                await op.write(key, data)
        except od.ConditionNotMatch:
            raise
        except _OPENDAL_ERRORS:
            if self._fs_root is not None:
                with contextlib.suppress(*_OPENDAL_ERRORS):
                    await op.delete(key)
            raise
        OBJECT_WRITE_SECONDS.observe(time.monotonic() - started)

    async def _sync_dirs(self, key: str) -> None:
        """fs: make the new object's directory entries durable.

        opendal's fs backend fsyncs the file it wrote but not the directories: after a power
        loss the object could be gone while the manifest (committed after the PUT returned)
        names it, and the WAL segment it came from deleted. Each directory from the object's
        up to the root is fsync'ed (new ones were created by this write).
        """
        root = self._fs_root
        if root is None:
            return

        def sync() -> None:
            directory = (root / key).parent
            while True:
                fsync_dir(directory)
                if directory == root or root not in directory.parents:
                    break
                directory = directory.parent

        try:
            await asyncio.to_thread(sync)
        except OSError as exc:
            raise ObjectStoreError(
                f"fsync of the directories of {key} in {self._description} failed: {exc}",
                retriable=True,
            ) from exc

    async def _move(self, op: opendal.AsyncOperator, source: str, target: str) -> None:
        if self._can_rename:  # fs: atomic
            await self._call("put_large", target, lambda: op.rename(source, target))
            await self._sync_dirs(target)
        elif self._can_copy:  # s3, gcs: server-side copy
            await self._call("put_large", target, lambda: op.copy(source, target))
        else:  # memory
            data = await self._call("put_large", source, lambda: op.read(source))
            await self._call("put_large", target, lambda: op.write(target, data))

    async def _discard(self, op: opendal.AsyncOperator, staging: str, *, retry: bool) -> None:
        """Remove a staging object; a leftover is logged, never raised. Without ``retry`` one
        attempt only, so a failed upload reports its error without waiting out the backoff."""
        try:
            if retry:
                await self._call("put_large", staging, lambda: op.delete(staging))
            else:
                await op.delete(staging)
        except ObjectStoreError as exc:
            self._log_leftover(staging, str(exc))
        except _OPENDAL_ERRORS as exc:
            self._log_leftover(staging, _detail(exc, self._secrets))

    def _log_leftover(self, staging: str, error: str) -> None:
        log.warning(
            "staging object left behind key=%s store=%s error=%s",
            staging,
            self._description,
            error,
        )

    def _operator(self, operation: str, key: str) -> opendal.AsyncOperator:
        if self._op is None:
            raise ObjectStoreError(f"{operation} {key} on {self._description}: store is closed")
        return self._op

    async def _call(
        self,
        operation: str,
        key: str,
        attempt: Callable[[], Awaitable[_T]],
        *,
        what: str = "",
    ) -> _T:
        """``attempt()``, retried per the policy; opendal errors become ObjectStoreError.
        ``what`` follows the key in messages (e.g. a byte range)."""
        retry = 0
        while True:
            try:
                return await attempt()
            except _OPENDAL_ERRORS as exc:
                error = self._error(operation, key, exc, attempts=retry + 1, what=what)
                if not error.retriable or retry >= self._retry.max_retries:
                    if not isinstance(error, ObjectNotFoundError):
                        self.stats.failures += 1
                    raise error from exc
                delay = self._retry.delay(retry)
                retry += 1
                self.stats.retries += 1
                log.warning(
                    "object store retry op=%s key=%s%s store=%s retry=%d delay=%.3fs error=%s",
                    operation,
                    key,
                    what,
                    self._description,
                    retry,
                    delay,
                    _detail(exc, self._secrets),
                )
                await asyncio.sleep(delay)

    def _error(
        self, operation: str, key: str, exc: Exception, *, attempts: int, what: str = ""
    ) -> ObjectStoreError:
        if isinstance(exc, od.NotFound):
            error = ObjectNotFoundError(key)
            # Its own message has no store in it; keep .key, say where we looked.
            error.args = (f"{operation} {key}{what} on {self._description}: object not found",)
            return error
        after = f" after {attempts} attempts" if attempts > 1 else ""
        return ObjectStoreError(
            f"{operation} {key}{what} on {self._description} failed{after}: "
            f"{_detail(exc, self._secrets)}",
            retriable=_is_retriable(exc),
        )


def _is_retriable(exc: Exception) -> bool:
    if isinstance(exc, _RETRIABLE):
        return True
    if isinstance(exc, _BY_STATUS):
        # opendal prints its ErrorStatus after the kind: "Unexpected (permanent) at read => …".
        # It is the only trace of it in Python; absent or "temporary"/"persistent": retry.
        return "(permanent)" not in str(exc).split("\n", 1)[0]
    return False


def _detail(exc: Exception, secrets: tuple[str, ...]) -> str:
    """opendal's first line plus its root cause, without context, headers or backtrace."""
    lines = str(exc).splitlines()
    detail = lines[0].strip() if lines else type(exc).__name__
    if "Source:" in (line.strip() for line in lines):
        index = [line.strip() for line in lines].index("Source:")
        cause = next((line.strip() for line in lines[index + 1 :] if line.strip()), "")
        if cause:
            detail = f"{detail}: {cause}"
    for secret in secrets:
        detail = detail.replace(secret, "***")
    return detail[:_MAX_DETAIL]


def _check_key(key: str) -> None:
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"object key must be a relative path to a file (got {key!r})")


def _describe(scheme: str, options: Mapping[str, str]) -> str:
    """``scheme://bucket/root (endpoint …)`` from the options that are not credentials."""
    root = options.get("root", "")
    if scheme == "fs":
        return f"fs://{root}"
    if scheme == "memory":
        return "memory://"
    bucket = options.get("bucket", "")
    where = f"{scheme}://{bucket}/{root.strip('/')}".rstrip("/")
    endpoint = options.get("endpoint")
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.username or parts.password:  # credentials in the URL: keep host and port
            netloc = parts.netloc.rsplit("@", 1)[1]
            endpoint = urlunsplit(parts._replace(netloc=netloc))
        where = f"{where} (endpoint {endpoint})"
    return where
