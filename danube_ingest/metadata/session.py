"""``BrokerSession``: a broker's registration in etcd, kept alive by its lease.

Guarantees:

* ``start()`` registers ``brokers/{id}`` = ``{url, started_ms, regions, metrics_url}`` under a fresh
  lease (``regions``: how many WAL region logs the broker runs, for the control plane;
  ``metrics_url``: its metrics endpoint when it serves one, for ``status``), and
  refuses (``BrokerIdConflictError``) while another live broker holds the same id.
* While ``alive``, the lease has been refreshed less than ``ttl`` seconds ago (measured from
  when the refresh was *sent*), so etcd still holds it: keys under it (the registration, the
  topic owner keys) exist. ``alive`` turns false no later than ``ttl`` seconds after the last
  successful refresh, even if etcd cannot be reached to confirm the expiry.
* On loss, every ``on_lost`` callback runs once, then the session keeps trying to register
  again under a new lease (after revoking the old one, so nothing of it outlives the loss),
  every 0.5 s (at most every ttl/3) until etcd answers.
* Taking back a crashed process's registration: given ``data_dir_id`` (the id of the data
  directory this process holds locked, ``danube_ingest.datadir``), the registration carries it
  and the host name. A registration with the same id and host can only have been left by a
  previous process of this broker on this data directory, which is dead (we hold the lock it
  held), so ``start()`` revokes that lease at once (deleting the old registration and the topic
  owner keys under it) and registers, instead of waiting up to ``ttl`` for it to expire. Any
  other holder of the id is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

from danube_ingest.metadata.errors import (
    BrokerIdConflictError,
    LeaseExpiredError,
    MetadataError,
)
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Get, KeyValue, Put

log = logging.getLogger(__name__)

SessionLostCallback = Callable[[], None]

#: After a failed refresh, try again this often (capped at ttl/3) until the lease is known to
#: be gone or its TTL has run out locally.
_RETRY_SECONDS = 0.5


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class BrokerSession:
    """A broker's lease-backed registration. Use from one event loop."""

    def __init__(
        self,
        kv: KV,
        keys: Keys,
        broker_id: str,
        advertised_url: str,
        ttl: int = 10,
        *,
        regions: int = 1,
        data_dir_id: str | None = None,
        metrics_url: str | None = None,
    ) -> None:
        if ttl < 1:
            raise MetadataError(f"session TTL must be at least 1 second, got {ttl}")
        self.kv = kv
        self.keys = keys
        self.broker_id = broker_id
        self.advertised_url = advertised_url
        self.ttl = ttl
        self.regions = regions
        self.data_dir_id = data_dir_id
        self.metrics_url = metrics_url
        self.host = socket.gethostname()
        self._key = keys.broker(broker_id)
        self._lease_id: int | None = None
        self._alive = False
        self._deadline = 0.0
        self._callbacks: list[SessionLostCallback] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def lease_id(self) -> int | None:
        """The current lease (``None`` before ``start``). Changes when the session re-registers."""
        return self._lease_id

    @property
    def alive(self) -> bool:
        """Whether the registration certainly still exists (see the module docstring)."""
        return self._alive and time.monotonic() < self._deadline

    def on_lost(self, callback: SessionLostCallback) -> None:
        """Call ``callback()`` each time the lease is lost (expired, revoked, or unrenewable)."""
        self._callbacks.append(callback)

    async def start(self) -> None:
        """Register, then keep the lease alive in the background until :meth:`close`.

        Raises ``BrokerIdConflictError`` if another live broker holds this id, and
        ``MetadataUnavailableError`` if etcd cannot be reached. A registration left by a dead
        previous process on the same data directory is taken back at once (module docstring).
        """
        if self._closed or self._task is not None:
            raise MetadataError(f"broker session {self.broker_id} was already started")
        try:
            await self._register()
        except BrokerIdConflictError as exc:
            holder = exc.holder
            if holder is None or holder.lease is None or not self._left_by_us(holder):
                raise
            log.info(
                "taking back the registration of a previous process broker=%s lease=%x "
                "data_dir_id=%s",
                self.broker_id,
                holder.lease,
                self.data_dir_id,
            )
            await self.kv.revoke_lease(holder.lease)
            await self._register()
        self._task = asyncio.create_task(self._keepalive(), name=f"broker-session-{self.broker_id}")

    async def close(self) -> None:
        """Stop the keepalive and revoke the lease (deleting every key under it). Idempotent.

        Does not call ``on_lost``: giving the lease up is not losing it.
        """
        if self._closed:
            return
        self._closed = True
        self._alive = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease_id is not None:
            await self._revoke_quietly(self._lease_id)
            log.info("broker session closed broker=%s", self.broker_id)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _register(self) -> None:
        sent = time.monotonic()
        lease_id = await self.kv.grant_lease(self.ttl)
        registration: dict[str, object] = {
            "url": self.advertised_url,
            "started_ms": _now_ms(),
            "regions": self.regions,
        }
        if self.metrics_url is not None:
            registration["metrics_url"] = self.metrics_url
        if self.data_dir_id is not None:
            registration["data_dir_id"] = self.data_dir_id
            registration["host"] = self.host
        value = json.dumps(registration).encode()
        try:
            result = await self.kv.txn(
                [Compare.absent(self._key)], [Put(self._key, value, lease_id)], [Get(self._key)]
            )
        except BaseException:
            await self._revoke_quietly(lease_id)
            raise
        if not result.succeeded:
            await self._revoke_quietly(lease_id)
            holder = result.kv(0)
            url = "?"
            if holder is not None:
                with contextlib.suppress(ValueError, AttributeError):
                    url = str(json.loads(holder.value).get("url", "?"))
            raise BrokerIdConflictError(
                f"broker id {self.broker_id!r} is already registered by a live broker at {url}: "
                f"stop that broker, give this one another id, or wait up to {self.ttl}s for its "
                "lease to expire",
                holder=holder,
            )
        self._lease_id = lease_id
        self._deadline = sent + self.ttl
        self._alive = True
        log.info(
            "broker registered broker=%s url=%s lease=%x ttl=%s",
            self.broker_id,
            self.advertised_url,
            lease_id,
            self.ttl,
        )

    def _left_by_us(self, holder: KeyValue) -> bool:
        """Whether ``holder`` is the registration of a previous process on our data directory."""
        if self.data_dir_id is None:
            return False
        try:
            stored = json.loads(holder.value)
        except ValueError:
            return False
        return (
            isinstance(stored, dict)
            and stored.get("data_dir_id") == self.data_dir_id
            and stored.get("host") == self.host
        )

    async def _keepalive(self) -> None:
        interval = self.ttl / 3
        delay = interval
        # Not ``while True``: Python 3.11's ``asyncio.wait_for`` (in ``_refresh``) swallows a
        # cancel that comes as the refresh completes (cpython gh-86296); ``close`` sets
        # ``_closed`` first, so the loop still ends (and never registers again).
        while not self._closed:
            await asyncio.sleep(delay)
            if self._closed:
                return
            if self._alive:
                delay = interval if await self._refresh() else min(_RETRY_SECONDS, interval)
                continue
            old = self._lease_id
            if old is not None:
                await self._revoke_quietly(old)
            try:
                await self._register()
                delay = interval
            except MetadataError as exc:
                log.warning("broker re-registration failed broker=%s error=%s", self.broker_id, exc)
                # Nothing is served while unregistered: try again soon, not a third of a TTL later.
                delay = min(_RETRY_SECONDS, interval)

    async def _refresh(self) -> bool:
        assert self._lease_id is not None
        sent = time.monotonic()
        try:
            # Never wait past the local deadline: by then the lease may be gone at etcd.
            async with asyncio.timeout(max(0.0, self._deadline - sent)):
                await self.kv.refresh_lease(self._lease_id)
        except LeaseExpiredError:
            self._lose("the lease expired")
            return False
        except (MetadataError, TimeoutError) as exc:
            if time.monotonic() >= self._deadline:
                self._lose(f"no refresh succeeded within the {self.ttl}s TTL ({exc or 'timeout'})")
            else:
                log.warning("lease refresh failed broker=%s error=%s", self.broker_id, exc)
            return False
        self._deadline = sent + self.ttl
        return True

    def _lose(self, reason: str) -> None:
        self._alive = False
        log.warning(
            "broker session lost broker=%s lease=%x reason=%s",
            self.broker_id,
            self._lease_id or 0,
            reason,
        )
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("session on_lost callback failed broker=%s", self.broker_id)

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self.kv.revoke_lease(lease_id)
        except MetadataError as exc:
            log.warning("lease revoke failed lease=%x error=%s", lease_id, exc)
