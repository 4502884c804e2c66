"""``EtcdKV``: the ``KV`` contract over etcd v3, through ``aetcd`` (asyncio gRPC).

Errors are mapped so callers never see ``aetcd`` or gRPC types:

* no answer to a read, or a write that provably never left (the connection could not be
  established) → ``MetadataUnavailableError`` (retriable);
* a write that timed out or whose connection broke after it was sent →
  ``CommitStateUnknownError`` (re-read before retrying);
* a put or refresh on a lease etcd no longer knows → ``LeaseExpiredError``;
* etcd auth (``EtcdSecurity``): wrong credentials, or an operation the user's roles do not
  allow → ``MetadataError`` (permanent, naming what to fix); a token etcd forgot (restart,
  idle past ``--auth-token-ttl``) → a new token is fetched and the call raises
  ``MetadataUnavailableError`` (it was refused, so retrying is safe).

Leases are granted, refreshed once per call (``refresh_lease``; the caller runs the keepalive
loop, see ``BrokerSession``) and revoked. etcd rounds a TTL up to its minimum
(1.5 x election timeout, so 2 s with default server flags) and checks expiry every 500 ms, so a
lease can outlive its TTL by about half a second. A transaction may hold at most 128 ops per
branch (etcd's default ``--max-txn-ops``).
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import aetcd
from aetcd.utils import prefix_range_end

from danube_ingest.metadata.errors import (
    CommitStateUnknownError,
    LeaseExpiredError,
    MetadataError,
    MetadataUnavailableError,
    RevisionCompactedError,
)
from danube_ingest.metadata.etcd_security import INVALID_TOKEN, EtcdSecurity, SecureClient
from danube_ingest.metadata.kv import (
    Compare,
    Delete,
    Get,
    KeyValue,
    OpResult,
    Put,
    TxnOp,
    TxnResult,
    WatchEvent,
    WatchStream,
    check_compare,
)

log = logging.getLogger(__name__)

_COMPARE_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}
#: gRPC channel options. gRPC reconnects a broken channel with exponential backoff up to 120 s
#: by default: after a 30 s etcd outage the broker reached etcd again only ~14 s after it was
#: back (measured), and every publish and consumer waited that long. Retrying the connection
#: every 0.5 s at most costs one TCP connect attempt per half second while etcd is down.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
}
# etcd answers NOT_FOUND with this text for a lease it does not know; aetcd maps NOT_FOUND to
# its generic ClientError, so the text is the only way to recognise it.
_LEASE_NOT_FOUND = "requested lease not found"


#: etcd's message for a compaction at or below the last one (``mvcc.ErrCompacted``).
_COMPACTED = "required revision has been compacted"


#: etcd's messages for wrong credentials, a request without a token while auth is enabled, and
#: an operation the user's roles do not allow (aetcd has no exception class for the last).
_AUTH_FAILED = "authentication failed"
_USER_EMPTY = "user name is empty"
_PERMISSION_DENIED = "permission denied"


class _PermissionDeniedError(MetadataError):
    """etcd refused an operation the user's roles do not allow."""


def _auth_error(endpoint: str, what: str, exc: Exception) -> MetadataError:
    return MetadataError(
        f"etcd {endpoint}: {what}: etcd refused the credentials ({exc}): check etcd.user and "
        "etcd.password / etcd.password_file (or the client certificate's name)"
    )


def _encode(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _kv(raw: Any) -> KeyValue:
    """Convert an aetcd ``KeyValue`` or a raw protobuf ``mvccpb.KeyValue``."""
    return KeyValue(
        key=bytes(raw.key).decode("utf-8", "surrogateescape"),
        value=bytes(raw.value),
        create_revision=int(raw.create_revision),
        mod_revision=int(raw.mod_revision),
        version=int(raw.version),
        lease=int(raw.lease) or None,
    )


def _never_sent(error: Exception) -> bool:
    # gRPC reports a connection it could not establish as "failed to connect to all addresses":
    # the request never left this process, so even a write is known not to have happened.
    return "failed to connect" in str(error).lower()


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"http://127.0.0.1:2379"`` (or ``"127.0.0.1:2379"``, or ``https://...``) →
    ``("127.0.0.1", 2379)``."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.scheme not in ("http", "https"):
        raise MetadataError(
            f"etcd endpoint {endpoint!r}: use http:// or https:// (TLS, see etcd.ca_file)"
        )
    if not parts.hostname:
        raise MetadataError(f"etcd endpoint {endpoint!r} has no host")
    return parts.hostname, parts.port or 2379


class _EtcdWatch(WatchStream):
    def __init__(self, owner: EtcdKV, prefix: str, watch: Any) -> None:
        self._owner = owner
        self._prefix = prefix
        self._watch = watch
        self._events = watch.__aiter__()
        self._done = False

    async def __anext__(self) -> WatchEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._events.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except aetcd.RevisionCompactedError as exc:
            self._done = True
            raise RevisionCompactedError(
                f"etcd {self._owner.endpoint}: watch on {self._prefix} was compacted away",
                int(exc.compacted_revision),
            ) from exc
        except aetcd.ClientError as exc:
            self._done = True
            raise MetadataUnavailableError(
                f"etcd {self._owner.endpoint}: watch on {self._prefix} broke: {exc}"
            ) from exc
        return WatchEvent("put" if event.kind == "PUT" else "delete", _kv(event.kv))

    async def cancel(self) -> None:
        if self._done:
            return
        self._done = True
        if self._owner.closed:
            return  # closing the client already ended every watch
        try:
            await self._watch.cancel()
        except aetcd.ClientError as exc:
            log.debug("etcd watch cancel failed prefix=%s error=%s", self._prefix, exc)


class EtcdKV:
    """The ``KV`` contract over one etcd cluster. Create with :meth:`connect`.

    Keys are used exactly as given (the ``Keys`` helper adds the ``/danube`` prefix). Reads are
    linearizable. Every call is bounded by ``timeout`` except watches, which stay open. Use from
    the event loop that connected.
    """

    def __init__(self, client: aetcd.Client, endpoint: str, timeout: float) -> None:
        self._client = client
        self._endpoint = endpoint
        self._timeout = timeout
        self._closed = False

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        security: EtcdSecurity | None = None,
    ) -> EtcdKV:
        """Connect to the first endpoint that answers a read within ``timeout`` seconds.

        ``https://`` endpoints use TLS with ``security``'s CA and client certificate (the
        system's roots without a CA); ``security.user`` authenticates (etcd auth). Raises
        ``MetadataUnavailableError`` naming every endpoint tried when none answers, and
        ``MetadataError`` at once for wrong credentials or a TLS file that cannot be read. A
        connection stays with the endpoint it found; it does not fail over to another later.
        """
        if not endpoints:
            raise MetadataError("no etcd endpoints configured")
        security = security or EtcdSecurity()
        failures: list[str] = []
        for endpoint in endpoints:
            host, port = parse_endpoint(endpoint)
            tls = endpoint.startswith("https://")
            client = SecureClient(
                host=host,
                port=port,
                credentials=security.channel_credentials() if tls else None,
                user=security.user,
                password=security.password,
                timeout=timeout,
                options=_CHANNEL_OPTIONS,
            )
            kv = cls(client, endpoint, timeout)
            try:
                await kv.get("/")
            except _PermissionDeniedError:
                pass  # a user without rights on "/": etcd answered and took the credentials
            except MetadataUnavailableError as exc:
                failures.append(str(exc))
                await kv.close()
                continue
            except BaseException:
                await kv.close()
                raise
            log.info("etcd connected endpoint=%s", endpoint)
            return kv
        raise MetadataUnavailableError(
            f"no etcd endpoint answered within {timeout}s: {'; '.join(failures)}"
        )

    @property
    def endpoint(self) -> str:
        """The endpoint this client talks to."""
        return self._endpoint

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    async def get(self, key: str) -> KeyValue | None:
        """See ``KV.get``."""
        found = await self._rpc(f"get {key}", self._client.get(_encode(key)), write=False)
        return None if found is None else _kv(found)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """See ``KV.get_prefix``."""
        found = await self._rpc(
            f"get prefix {prefix}", self._client.get_prefix(_encode(prefix)), write=False
        )
        return [_kv(raw) for raw in found.kvs]

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """See ``KV.put``."""
        done = await self._rpc(
            f"put {key}", self._client.put(_encode(key), value, lease=lease), write=True
        )
        return int(done.header.revision)

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        """See ``KV.delete``."""
        if prefix:
            call = self._client.delete_prefix(_encode(key))
        else:
            call = self._client.delete(_encode(key))
        done = await self._rpc(f"delete {key}", call, write=True)
        return 0 if done is None else int(done.deleted)

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """See ``KV.txn``."""
        for compare in compares:
            check_compare(compare)
        writes = any(isinstance(op, Put | Delete) for op in (*success, *failure))
        touched = [c.key for c in compares] + [op.key for op in (*success, *failure)]
        what = f"txn on {touched[0]}" if touched else "empty txn"
        succeeded, responses = await self._rpc(
            what,
            self._client.transaction(
                compare=[self._compare(c) for c in compares],
                success=[self._op(op) for op in success],
                failure=[self._op(op) for op in failure],
            ),
            write=writes,
        )
        ran = success if succeeded else failure
        results: list[OpResult] = []
        for op, response in zip(ran, responses, strict=True):
            if isinstance(op, Get):
                results.append(OpResult(kvs=tuple(_kv(got) for _, got in response)))
            elif isinstance(op, Delete):
                results.append(OpResult(deleted=int(response.response_delete_range.deleted)))
            else:
                results.append(OpResult())
        return TxnResult(bool(succeeded), tuple(results))

    async def grant_lease(self, ttl: int) -> int:
        """See ``KV.grant_lease``.

        Safe to retry after an error: a lease granted by a lost call just expires unused.
        """
        lease = await self._rpc(f"grant lease ttl={ttl}", self._client.lease(ttl), write=False)
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        """See ``KV.refresh_lease``."""
        reply = await self._rpc(
            f"refresh lease {lease_id:x}", self._client.refresh_lease(lease_id), write=False
        )
        # etcd answers a keepalive for an unknown lease with TTL 0 rather than an error.
        if reply is None or int(reply.TTL) <= 0:
            raise LeaseExpiredError(f"lease {lease_id:x} has expired or was revoked")
        return int(reply.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        """See ``KV.revoke_lease``."""
        with contextlib.suppress(LeaseExpiredError):
            await self._rpc(
                f"revoke lease {lease_id:x}", self._client.revoke_lease(lease_id), write=False
            )

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> WatchStream:
        """See ``KV.watch_prefix``."""
        raw = _encode(prefix)
        watch = await self._rpc(
            f"watch {prefix}",
            self._client.watch(raw, range_end=prefix_range_end(raw), start_revision=start_revision),
            write=False,
        )
        return _EtcdWatch(self, prefix, watch)

    async def compact(self, revision: int) -> None:
        """See ``KV.compact``: etcd's own, not waiting for the physical compaction."""
        try:
            await self._rpc(f"compact {revision}", self._client.compact(revision), write=True)
        except MetadataError as exc:
            # etcd answers a compaction at or below the last one with this plain error.
            if isinstance(exc, RevisionCompactedError) or _COMPACTED not in str(exc):
                raise
            raise RevisionCompactedError(
                f"etcd {self._endpoint}: compact {revision}: already compacted at or past it",
                revision,
            ) from exc

    async def db_size(self) -> int | None:
        """See ``KV.db_size``: the answering member's database size."""
        status = await self._rpc("status", self._client.status(), write=False)
        return int(status.db_size)

    async def identity(self, key: str) -> str:
        """See ``KV.identity``: etcd's cluster id, from the header every member's answers
        carry (read with a range of ``key`` alone, which any role that may read it may do)."""
        raw = _encode(key)
        found = await self._rpc(f"get {key}", self._client.get_range(raw, raw + b"\0"), write=False)
        return f"etcd cluster {int(found.header.cluster_id):016x}"

    async def close(self) -> None:
        """See ``KV.close``."""
        if self._closed:
            return
        self._closed = True
        await self._client.close()

    def _compare(self, compare: Compare) -> Any:
        t = self._client.transactions
        target = {"value": t.value, "version": t.version, "create": t.create, "mod": t.mod}
        return _COMPARE_OPS[compare.op](target[compare.target](_encode(compare.key)), compare.value)

    def _op(self, op: TxnOp) -> Any:
        t = self._client.transactions
        raw = _encode(op.key)
        if isinstance(op, Put):
            return t.put(raw, op.value, lease=op.lease)
        range_end = prefix_range_end(raw) if op.prefix else None
        if isinstance(op, Delete):
            return t.delete(raw, range_end=range_end)
        return t.get(raw, range_end=range_end)

    async def _rpc(self, what: str, call: Awaitable[Any], *, write: bool) -> Any:
        if self._closed:
            close = getattr(call, "close", None)
            if close is not None:
                close()  # the coroutine was never awaited
            raise MetadataError(f"etcd {self._endpoint}: {what}: the client is closed")
        try:
            return await call
        except aetcd.RevisionCompactedError as exc:
            raise RevisionCompactedError(
                f"etcd {self._endpoint}: {what}: revision compacted below {exc.compacted_revision}",
                int(exc.compacted_revision),
            ) from exc
        except (aetcd.ConnectionTimeoutError, aetcd.WatchTimeoutError, TimeoutError) as exc:
            if write:
                raise CommitStateUnknownError(
                    f"etcd {self._endpoint}: {what} timed out after {self._timeout}s; it may or "
                    "may not have been applied: re-read before retrying"
                ) from exc
            raise MetadataUnavailableError(
                f"etcd {self._endpoint}: {what} timed out after {self._timeout}s"
            ) from exc
        except aetcd.ConnectionFailedError as exc:
            if write and not _never_sent(exc):
                raise CommitStateUnknownError(
                    f"etcd {self._endpoint}: connection lost during {what} ({exc}); it may or "
                    "may not have been applied: re-read before retrying"
                ) from exc
            raise MetadataUnavailableError(
                f"etcd {self._endpoint} is unavailable: {what} failed: {exc}"
            ) from exc
        except aetcd.exceptions.UnauthenticatedError as exc:
            if INVALID_TOKEN not in str(exc):
                raise _auth_error(self._endpoint, what, exc) from exc
            # etcd restarted or the token idled out: etcd refused the request (not applied).
            try:
                await self._client.reauthenticate()
            except aetcd.ClientError as again:
                raise MetadataUnavailableError(
                    f"etcd {self._endpoint}: {what} was refused with an expired auth token, "
                    f"and authenticating again failed: {again}"
                ) from exc
            raise MetadataUnavailableError(
                f"etcd {self._endpoint}: {what} was refused with an expired auth token; "
                "authenticated again: retry"
            ) from exc
        except aetcd.ClientError as exc:
            if _LEASE_NOT_FOUND in str(exc):
                raise LeaseExpiredError(
                    f"etcd {self._endpoint}: {what}: the lease has expired or was revoked"
                ) from exc
            if _AUTH_FAILED in str(exc) or _USER_EMPTY in str(exc):
                raise _auth_error(self._endpoint, what, exc) from exc
            if _PERMISSION_DENIED in str(exc):
                raise _PermissionDeniedError(
                    f"etcd {self._endpoint}: {what}: permission denied: grant the etcd user "
                    "(etcd.user) a role with read and write access to etcd.prefix"
                ) from exc
            raise MetadataError(f"etcd {self._endpoint}: {what} failed: {exc}") from exc
