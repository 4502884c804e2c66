"""TLS and user/password authentication for the etcd client (``EtcdSecurity``).

``aetcd`` opens only plain channels, so ``SecureClient`` opens the gRPC channel itself: TLS
(``grpc.ssl_channel_credentials``: the CA, optionally a client certificate) for ``https://``
endpoints, and etcd's ``Authenticate`` call when a user is set, whose token goes with every
request. etcd forgets tokens when it restarts and after ``--auth-token-ttl`` (300 s by default)
without use; a request refused with "invalid auth token" makes ``reauthenticate`` fetch a new
one, and the request fails retriably (``EtcdKV`` maps it to ``MetadataUnavailableError``: etcd
refused it, so a write was not applied).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aetcd
import grpc
from aetcd import rpc, watcher

from danube_ingest.metadata.errors import MetadataError

if TYPE_CHECKING:
    from danube_ingest.config.models import EtcdConfig

#: Environment variables of ``EtcdSecurity.from_env``, by the ``etcd:`` key they stand for.
ENV = {
    "ca_file": "DANUBE_INGEST_ETCD_CA_FILE",
    "cert_file": "DANUBE_INGEST_ETCD_CERT_FILE",
    "key_file": "DANUBE_INGEST_ETCD_KEY_FILE",
    "user": "DANUBE_INGEST_ETCD_USER",
    "password": "DANUBE_INGEST_ETCD_PASSWORD",
    "password_file": "DANUBE_INGEST_ETCD_PASSWORD_FILE",
}

#: etcd's answer to a request whose token it no longer knows (``auth.ErrInvalidAuthToken``).
INVALID_TOKEN = "invalid auth token"


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a secured etcd: TLS files (used for ``https://`` endpoints) and the user.

    ``password`` is never part of ``repr``. With a client certificate and no user, an etcd with
    auth enabled takes the certificate's common name as the user.
    """

    ca_file: Path | None = None
    """PEM CA certificates for the server's certificate; None: the system's roots."""
    cert_file: Path | None = None
    """PEM client certificate (etcd ``--client-cert-auth``)."""
    key_file: Path | None = None
    """PEM private key of ``cert_file``."""
    user: str | None = None
    """etcd user name (etcd ``auth enable``)."""
    password: str | None = field(default=None, repr=False)
    """Password of ``user``."""

    @classmethod
    def from_config(cls, config: EtcdConfig) -> EtcdSecurity:
        """The security of an ``etcd:`` config section; reads ``password_file`` now.

        Raises ``MetadataError`` naming the file if it cannot be read.
        """
        password = None
        if config.password is not None:
            password = config.password.get_secret_value()
        elif config.password_file is not None:
            password = read_password_file(config.password_file)
        return cls(
            ca_file=config.ca_file,
            cert_file=config.cert_file,
            key_file=config.key_file,
            user=config.user,
            password=password,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
        """The security named by ``DANUBE_INGEST_ETCD_*`` variables (``ENV``): how processes
        started without a config file (Dagster runs, the Spark job) reach a secured etcd.
        Unset or empty variables mean None; ``PASSWORD_FILE`` is read now."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(ENV[name]) or None

        def path(name: str) -> Path | None:
            value = get(name)
            return None if value is None else Path(value)

        password = get("password")
        password_file = path("password_file")
        if password is None and password_file is not None:
            password = read_password_file(password_file)
        return cls(
            ca_file=path("ca_file"),
            cert_file=path("cert_file"),
            key_file=path("key_file"),
            user=get("user"),
            password=password,
        )

    @classmethod
    def from_env_or_config(cls, config: EtcdConfig) -> EtcdSecurity:
        """The environment's (``from_env``) if it sets any variable, else ``config``'s: what
        a process started by the Dagster resource (which sets both the endpoints and these
        variables) uses beside a broker YAML."""
        security = cls.from_env()
        return security if security != cls() else cls.from_config(config)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials of these files; ``MetadataError`` naming a file it cannot read."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "etcd.ca_file"),
            private_key=_read(self.key_file, "etcd.key_file"),
            certificate_chain=_read(self.cert_file, "etcd.cert_file"),
        )


def read_password_file(path: Path) -> str:
    """The password in ``path`` without its trailing newline; ``MetadataError`` if unreadable."""
    try:
        return path.read_text().rstrip("\r\n")
    except OSError as exc:
        raise MetadataError(
            f"cannot read etcd.password_file {path}: {exc.strerror or exc}; fix the path or "
            "its permissions"
        ) from exc


def _read(path: Path | None, key: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise MetadataError(
            f"cannot read {key} {path}: {exc.strerror or exc}; fix the path or its permissions"
        ) from exc


class _Watcher(watcher.Watcher):  # type: ignore[misc]
    """aetcd's watcher, with each watch stream reading only its own request queue.

    When a stream breaks, aetcd ends it by putting ``None`` into its request queue and starts
    a new queue for the next stream. aetcd's request generator looked the queue up again on
    every request: if the stream broke while it was writing a request, it went on to wait on
    the *new* queue, for ever, and grpc's task running it was destroyed pending with the call
    ("Task was destroyed but it is pending!", seen after a paused broker resumed).
    """

    async def _iter_request(self) -> AsyncIterator[Any]:
        queue = self._request_queue
        while True:
            request = await queue.get()
            if request is None:
                return
            yield request


class SecureClient(aetcd.Client):  # type: ignore[misc]
    """``aetcd.Client`` over a TLS channel (when ``credentials`` are given) that can fetch a
    new auth token (``reauthenticate``). ``connect`` replaces aetcd's, which opens plain
    channels only, and ``refresh_lease`` replaces aetcd's, which leaves its keepalive call
    behind; everything else is aetcd's."""

    # Set by aetcd.Client.__init__ (untyped there).
    _is_connecting: bool
    metadata: tuple[tuple[str, str], ...] | None

    def __init__(
        self,
        *,
        host: str,
        port: int,
        credentials: grpc.ChannelCredentials | None,
        user: str | None,
        password: str | None,
        timeout: float,
        options: dict[str, Any],
    ) -> None:
        super().__init__(
            host=host,
            port=port,
            username=user,
            password=password,
            timeout=timeout,
            options=options,
        )
        self._credentials = credentials

    async def connect(self) -> None:
        """Open the channel (TLS if credentials were given) and authenticate if a user is set.

        Raises ``aetcd`` errors as ``aetcd.Client.connect`` does (wrong credentials:
        ``InvalidArgumentError``; no answer: ``ConnectionFailedError``/``ConnectionTimeoutError``).
        """
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            async with asyncio.timeout(self._connect_wait_timeout):
                await self._connected.wait()
            return
        self._is_connecting = True
        try:
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._credentials is None:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            else:
                self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            if self._username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                await self.reauthenticate()
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = _Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False

    async def refresh_lease(self, lease_id: int) -> Any:
        """One keepalive for ``lease_id``: etcd's reply (``TTL`` 0 for an unknown lease), or
        ``None`` if the stream ended without one. Raises ``aetcd`` errors.

        aetcd returns from inside the streaming call and leaves the call, with grpc's task
        writing the request, to the garbage collector; here both are cancelled before
        returning, so no task outlives the call.
        """
        await self.connect()
        call = self.leasestub.LeaseKeepAlive(
            iter((rpc.LeaseKeepAliveRequest(ID=lease_id),)),
            timeout=self._timeout,
            metadata=self.metadata,
        )
        try:
            async for reply in call:
                return reply
            return None
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
        finally:
            call.cancel()
            # grpc cancels its request-writing task only if the call was still running.
            writer = getattr(call, "_async_request_poller", None)
            if writer is not None and not writer.done():
                writer.cancel()

    async def reauthenticate(self) -> None:
        """Fetch a new auth token (after etcd answered ``invalid auth token``). No-op without a
        user or before ``connect``."""
        if self._username is None or self.auth_stub is None:
            return
        try:
            reply = await self.auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password),
                timeout=self._timeout,
            )
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
        self.metadata = (("token", reply.token),)
        if self._watcher is not None:
            self._watcher._metadata = self.metadata
