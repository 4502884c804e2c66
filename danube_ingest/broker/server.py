"""Broker: one daemon serving Danube's client protocol on one port.

Start-up order: lock the data directory (and the WAL directory) so no other process can use
it (``danube_ingest.datadir``; a second broker on it fails at once naming the holder's pid),
bind the port and answer every call ``UNAVAILABLE`` (clients retry at once instead of hanging
on a port that accepts connections but serves nothing), serve the metrics port
(``metrics.listen``: ``/metrics``, ``/healthz``, and ``/readyz``, which answers 503 until the
broker serves and again from the start of its shutdown), recover the WAL, connect to etcd,
check that the data directory belongs to this metadata store (``datadir.check_metadata_store``)
and that the object store is the cluster's (``objects.cluster``), register the broker under a
lease (taking back at once the registration a crashed previous
process on this data directory left), then serve. Shutdown (``stop``) is the reverse and loses
nothing: streams end, in-flight publishes finish or fail within the grace period, cursors are
flushed, topics are released so another broker can take them over at once, the WAL is synced
and closed, the lease is revoked, the directories are unlocked, the metrics port is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from danube.proto import SchemaRegistry_pb2_grpc as schema_grpc
from prometheus_client import CollectorRegistry

from danube_ingest.broker.admin_service import add_subscription_admin
from danube_ingest.broker.batch import add_ingest_service
from danube_ingest.broker.errors import ListenError, TlsSetupError
from danube_ingest.broker.forward import Forwarder
from danube_ingest.broker.services import add_services
from danube_ingest.broker.tls import check_listen, server_credentials
from danube_ingest.broker.topics import TopicManager
from danube_ingest.config import BrokerConfig
from danube_ingest.datadir import DataDirLock, check_metadata_store, data_dir_id
from danube_ingest.dispatch import DispatchPolicy, PoisonPolicy
from danube_ingest.metadata.durable import DurableEndRecorder, EndsSource
from danube_ingest.metadata.errors import BrokerIdConflictError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, KeyValue, MemoryKV
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.metadata.offsets import OffsetReservation
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.metadata.progress import ProgressUpdater
from danube_ingest.metadata.records import Records
from danube_ingest.metadata.session import BrokerSession
from danube_ingest.objects.cleaner import WalCleaner
from danube_ingest.objects.cluster import check_cluster_id
from danube_ingest.objects.handover import TailHandover
from danube_ingest.objects.kafka_rescue import KafkaTailRescue
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.reclock import ClockKeeper
from danube_ingest.objects.store import ObjectStore, RetryPolicy
from danube_ingest.objects.uploader import SegmentUploader
from danube_ingest.observability.collector import BrokerCollector
from danube_ingest.observability.http import ObservabilityServer
from danube_ingest.observability.metrics import REGISTRY
from danube_ingest.observability.rpc import RpcMetrics
from danube_ingest.schema.kvstore import KVSchemaStore
from danube_ingest.schema.registry import SchemaRegistry
from danube_ingest.schema.service import SchemaRegistryServicer
from danube_ingest.security import AuthInterceptor, Guard
from danube_ingest.store import TopicStore
from danube_ingest.store.topic_store import kafka_wal

log = logging.getLogger(__name__)

#: gRPC frames carry a payload plus headers; leave room above the payload limit for them.
_GRPC_OVERHEAD = 64 * 1024
#: Publish requests up to this size are read and then refused with INVALID_ARGUMENT when their
#: payload is over the limit. Beyond it gRPC itself refuses with RESOURCE_EXHAUSTED, which
#: danube-client retries forever; so it is set well above the payload limit (the memory cost:
#: one such request buffer per concurrent oversized publish).
_GRPC_MIN_RECEIVE = 64 * 1024 * 1024


def dispatch_policy(config: BrokerConfig) -> DispatchPolicy:
    """The reliable dispatch policy the ``dispatch`` and ``limits`` sections describe."""
    d = config.dispatch
    return DispatchPolicy(
        max_unacked=config.limits.max_unacked_messages,
        ack_timeout_s=float(d.ack_timeout_seconds),
        nack_base_delay_s=d.nack_base_delay_ms / 1000,
        redelivery_base_s=d.redelivery_base_ms / 1000,
        redelivery_max_s=d.redelivery_max_ms / 1000,
        max_redeliveries=d.max_redeliveries,
        poison=PoisonPolicy(d.poison_policy),
        dead_letter_topic=d.dead_letter_topic,
    )


def data_dirs(config: BrokerConfig) -> list[Path]:
    """The directories a broker of ``config`` locks: its data directory and, unless storage is
    in memory, its WAL directory (also locked on its own, so ``wal repair --wal-dir`` sees it
    is in use however the WAL was named)."""
    dirs = [config.broker.data_dir]
    if config.storage.mode != "memory":
        dirs.append(config.wal_dir())
    return dirs


def _registration(stored: KeyValue | None) -> dict[str, object]:
    if stored is None:
        return {}
    try:
        value = json.loads(stored.value)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def _start_session(session: BrokerSession) -> None:
    """Register the broker. A registration left by a dead previous process on this data
    directory is taken back at once (``BrokerSession``); one left by a version that did not
    record its data directory (same URL, no ``data_dir_id``) is waited out, for at most one
    lease TTL; any other holder of the id is refused at once (``BrokerIdConflictError``)."""
    deadline = time.monotonic() + session.ttl + 1
    waiting = False
    while True:
        try:
            await session.start()
            return
        except BrokerIdConflictError as exc:
            stored = _registration(exc.holder)
            legacy_own = "data_dir_id" not in stored and stored.get("url") == session.advertised_url
            if (exc.holder is not None and not legacy_own) or time.monotonic() >= deadline:
                raise
            if not waiting:
                waiting = True
                log.info(
                    "waiting up to %ss for the registration of a previous process of "
                    "broker %s to expire",
                    session.ttl,
                    session.broker_id,
                )
            await asyncio.sleep(0.2)


async def _answer_starting(request_iterator: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAVAILABLE,
        "broker is starting (recovering its WAL, registering in etcd); retry shortly",
    )


#: Any method, any cardinality: a stream-stream handler without (de)serializers reads nothing.
_STARTING = grpc.stream_stream_rpc_method_handler(_answer_starting)


class _StartupGate:
    """The server's only generic handler: every call is answered ``UNAVAILABLE`` until
    ``open()``, then routed to the services added (``add_services`` registers them here)."""

    def __init__(self) -> None:
        self._handlers: list[grpc.GenericRpcHandler] = []
        self._open = False

    def add_generic_rpc_handlers(
        self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]
    ) -> None:
        self._handlers.extend(generic_rpc_handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        """Nothing to do: the generic handler registered with them routes the same methods."""

    def open(self) -> None:
        self._open = True

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if not self._open:
            return _STARTING
        for handler in self._handlers:
            found = handler.service(handler_call_details)
            if found is not None:
                return found
        return None


def _durable_ends(store: TopicStore, ownership: Ownership) -> EndsSource:
    """What ``DurableEndRecorder`` records: each owned topic's WAL high watermark (every
    acknowledged offset is below it) and the ownership epoch."""

    def ends() -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for topic in ownership.owned_topics():
            owner = ownership.owned(topic)
            info = store.info(topic)
            if owner is not None and info is not None:
                found[topic] = (info.high_watermark, owner.epoch)
        return found

    return ends


class Broker:
    """The ingest daemon. ``await start()``, then ``await stop()`` (or ``serve_until``)."""

    def __init__(
        self, config: BrokerConfig, *, kv: KV | None = None, lock: DataDirLock | None = None
    ) -> None:
        """``lock``: the caller's lock on ``data_dirs(config)`` (``danube-ingest dev`` takes it
        before starting etcd); by default ``start`` takes it and ``stop`` releases it."""
        self.config = config
        self.guard = Guard(config.auth)
        """Authentication and permissions (``auth``); reads its key files here."""
        self._kv = kv
        self._owns_kv = kv is None
        self._lock = lock
        self._owns_lock = lock is None
        self._server: grpc.aio.Server | None = None
        self.store: TopicStore | None = None
        self.manager: TopicManager | None = None
        self._forwarder: Forwarder | None = None
        self._session: BrokerSession | None = None
        self._progress: ProgressUpdater | None = None
        self._ownership: Ownership | None = None
        self.objects: ObjectStore | None = None
        self.uploader: SegmentUploader | None = None
        self.tail_handover: TailHandover | None = None
        self.kafka_rescue: KafkaTailRescue | None = None
        self._wal_id: str | None = None
        self.cleaner: WalCleaner | None = None
        self.clock_keeper: ClockKeeper | None = None
        self._durable: DurableEndRecorder | None = None
        self.port = 0
        self.url = ""
        self._http: ObservabilityServer | None = None
        self.metrics_url: str | None = None
        """``http://host:port`` of ``/metrics``, ``/healthz`` and ``/readyz`` (None: off)."""
        self._serving = False
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        """Start serving (see the module docstring for the order).

        Raises ``DataDirLockedError`` if another process holds the data directory,
        ``MetadataStoreMismatchError`` if it was made with another metadata store,
        ``ListenError`` if the listen address cannot be bound, ``BrokerIdConflictError`` if
        another live broker has this id. On any failure everything started is stopped again.
        """
        try:
            await self._start()
        except BaseException:
            await self.stop(grace=0)
            raise

    async def _start(self) -> None:
        config = self.config
        if self._lock is None:
            self._lock = DataDirLock.acquire(*data_dirs(config))
        dir_id = data_dir_id(config.broker.data_dir)
        gate = _StartupGate()
        server = self._bind(gate)
        await server.start()
        self._server = server
        await self._start_http()
        self.store = await TopicStore.from_config(config)
        # Stored with this broker's offset reservations: a takeover's tail can be recovered
        # only from the WAL it was written to (``objects.handover``). None: a WAL in memory.
        # A WAL in Kafka is named by its topics, not by the directory caching it: a broker
        # whose data directory was wiped recovers its tails from Kafka.
        kafka = kafka_wal(config)
        if kafka is not None:
            self._wal_id = "kafka:" + kafka.region("r0").data.rsplit(".", 1)[0]
        else:
            self._wal_id = (
                None if config.storage.mode == "memory" else data_dir_id(config.wal_dir())
            )
        if self._kv is None:
            endpoints = config.etcd.endpoints
            if endpoints == ["memory"]:
                self._kv = MemoryKV()
            else:
                self._kv = await EtcdKV.connect(
                    endpoints,
                    timeout=config.etcd.connect_timeout_seconds,
                    security=EtcdSecurity.from_config(config.etcd),
                )
        kv = self._kv
        keys = Keys(config.etcd.prefix)
        store_id = await kv.identity(keys.cluster_id())
        if store_id != "memory":
            store_id += f" prefix {keys.prefix}"
        # Before anything of this directory reaches the metadata store.
        check_metadata_store(config.broker.data_dir, store_id)
        self._session = BrokerSession(
            kv,
            keys,
            config.broker.broker_id,
            self.url,
            ttl=config.etcd.lease_ttl_seconds,
            regions=len(self.store.regions),
            data_dir_id=dir_id,
            metrics_url=self.metrics_url,
        )
        if config.storage.mode == "wal_cloud":
            # Before registering: a broker on another store than the cluster's never starts.
            # (Its own store instance: the data store's statistics count data objects only.)
            checked = ObjectStore.from_config(config)
            try:
                await check_cluster_id(kv, keys, checked)
            finally:
                await checked.close()
        await _start_session(self._session)
        ownership = Ownership(kv, keys, self._session)
        self._ownership = ownership
        self._progress = ProgressUpdater(ownership)
        records = Records(kv, keys)
        schemas = SchemaRegistry(KVSchemaStore(kv, keys))
        manifest = self._start_cold_path(kv, keys, ownership)
        self.manager = TopicManager(
            broker_id=config.broker.broker_id,
            broker_url=self.url,
            store=self.store,
            records=records,
            keys=keys,
            ownership=ownership,
            reservations=OffsetReservation(ownership, wal_id=self._wal_id),
            progress=self._progress,
            schemas=schemas,
            limits=config.limits,
            policy=dispatch_policy(config),
            consumer_idle_seconds=float(config.dispatch.consumer_idle_seconds),
            manifest=manifest,
            hand_over_on_close=self.uploader is not None,
            shutdown_upload_seconds=float(config.storage.uploader.shutdown_upload_seconds),
        )
        if self.clock_keeper is not None:
            self.clock_keeper.start()
        if config.storage.mode != "memory":
            self._durable = DurableEndRecorder(
                kv, keys, config.broker.broker_id, _durable_ends(self.store, ownership)
            )
            self._durable.start()
        self._forwarder = add_services(gate, self.manager, self.guard)
        add_ingest_service(gate, self.manager, self.guard)
        add_subscription_admin(gate, self.manager, self.guard)
        schema_grpc.add_SchemaRegistryServicer_to_server(SchemaRegistryServicer(schemas), gate)
        gate.open()
        self._serving = True
        tls = config.broker.tls
        log.info(
            "broker started broker_id=%s url=%s tls=%s wal=%s metrics=%s",
            config.broker.broker_id,
            self.url,
            ("mutual" if tls.require_client_cert else "on") if tls.enabled else "off",
            config.wal_dir() if config.storage.mode != "memory" else "memory",
            self.metrics_url or "off",
        )

    async def _start_http(self) -> None:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``metrics.listen`` (unless off);
        ``/readyz`` answers 503 until the broker serves."""
        listen = self.config.metrics_listen()
        if listen == "off":
            return
        own = CollectorRegistry(auto_describe=False)
        own.register(BrokerCollector(self, max_series=self.config.metrics.max_lag_series))
        http = ObservabilityServer(listen, [REGISTRY, own], self.readiness)
        try:
            await http.start()
        except OSError as exc:
            raise ListenError(
                f"cannot serve metrics on {listen} (metrics.listen "
                f"{self.config.metrics.listen}): {exc.strerror or exc}; "
                "stop the process using that port, choose another metrics.listen "
                "(--metrics-listen), or set it to off"
            ) from exc
        self._http = http
        self.metrics_url = http.url

    def readiness(self) -> str | None:
        """None while the broker serves; otherwise why it does not (``/readyz``'s 503)."""
        if self._stopped.is_set():
            return "shutting down"
        if not self._serving:
            return "starting: recovering the WAL and registering in etcd"
        session = self._session
        if session is None or not session.alive:
            return (
                "etcd session lost: the broker's lease is not renewed (is etcd reachable?); "
                "its topics are released until the session is back"
            )
        for region in self.store.regions if self.store is not None else []:
            if region.failure is not None:
                return (
                    f"WAL region {region.region} failed ({region.failure}); appends are "
                    "refused until the broker is restarted and recovers it"
                )
            if region.closed:
                return f"WAL region {region.region} is closed"
        return None

    def _bind(self, gate: _StartupGate) -> grpc.aio.Server:
        """A server bound to ``broker.listen`` with ``gate`` as its only handler; sets
        ``port`` and ``url``."""
        config = self.config
        max_message = config.limits.max_payload_bytes + _GRPC_OVERHEAD
        max_receive = max(4 * config.limits.max_payload_bytes, _GRPC_MIN_RECEIVE)
        # With auth off the interceptor would only pass every call through: each interceptor
        # costs every RPC a coroutine layer, and the danube-client path is one RPC per message.
        interceptors: list[grpc.aio.ServerInterceptor] = [RpcMetrics()]
        if self.guard.enabled:
            interceptors.append(AuthInterceptor(self.guard))
        server = grpc.aio.server(
            handlers=[gate],
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", max_receive),
                # Bounds concurrent calls (streams included) per client connection: a flood
                # queues at the client instead of failing with CANCELLED (never retried).
                ("grpc.max_concurrent_streams", 1000),
                ("grpc.max_send_message_length", max_message),
                # gRPC's default SO_REUSEPORT would let a second process bind the same port and
                # take half the new connections: a port in use must be an error.
                ("grpc.so_reuseport", 0),
            ],
        )
        listen = config.broker.listen
        tls = config.broker.tls
        check_listen(config.broker)
        try:
            if tls.enabled:
                self.port = server.add_secure_port(listen, server_credentials(tls))
            else:
                self.port = server.add_insecure_port(listen)
        except RuntimeError as exc:
            if tls.enabled:
                raise TlsSetupError(
                    f"cannot listen with TLS on {listen}: broker.tls.key_file ({tls.key_file}) "
                    f"may not be the key of broker.tls.cert_file ({tls.cert_file}), or the port "
                    "is in use by another process or the address is not one of this host"
                ) from exc
            raise ListenError(
                f"cannot listen on {listen}: the port is in use by another process or the "
                "address is not one of this host; stop that process or choose another --listen"
            ) from exc
        host = listen.rsplit(":", 1)[0]
        scheme = "https" if tls.enabled else "http"
        self.url = config.broker.advertised_url or f"{scheme}://{host}:{self.port}"
        return server

    def _start_cold_path(self, kv: KV, keys: Keys, ownership: Ownership) -> Manifest | None:
        """Object store, cloud reader, uploader and clock keeper (mode wal_cloud) and the WAL
        cleaner."""
        config = self.config
        storage = config.storage
        store = self.store
        assert store is not None
        manifest = None
        broker_id = config.broker.broker_id
        if storage.mode == "wal_cloud":
            self.objects = ObjectStore.from_config(config)
            manifest = Manifest(kv, keys)
            store.attach_cloud(CloudReader(manifest, self.objects))
            if storage.uploader.enabled:
                self.uploader = SegmentUploader(
                    store,
                    self.objects,
                    manifest,
                    ownership,
                    codec=storage.cloud.compression,
                    concurrency=storage.uploader.concurrency,
                    retry=RetryPolicy.from_config(storage.uploader),
                    max_bytes_per_second=storage.uploader.max_bytes_per_second,
                )
                self.tail_handover = TailHandover(
                    store,
                    self.uploader,
                    manifest,
                    ownership,
                    interval=float(storage.uploader.handover_check_seconds),
                    wal_id=self._wal_id,
                )
                kafka = kafka_wal(config)
                if kafka is not None:
                    # Takeovers from a dead broker read its tail from Kafka themselves.
                    self.kafka_rescue = KafkaTailRescue(
                        kafka,
                        self.objects,
                        manifest,
                        broker_id,
                        config.wal_dir() / "rescue",
                        codec=storage.cloud.compression,
                        index_interval=storage.wal.index_interval_bytes,
                    )
        self.cleaner = WalCleaner(
            store,
            broker_id=broker_id,
            retention=storage.wal.retention,
            kv=kv,
            keys=keys,
            require_upload=storage.mode == "wal_cloud",
            prune_consumed=storage.mode == "wal_cloud",
            interval=float(storage.wal.retention.check_seconds),
        )
        store.on_pressure = self.cleaner.wake
        if self.uploader is not None:
            self.uploader.on_uploaded(self.cleaner.wake)
            self.uploader.start()
            if self.tail_handover is not None:
                self.tail_handover.start()
            if self.kafka_rescue is not None:
                self.kafka_rescue.start()
            if storage.clock_interval_seconds > 0:
                # Started once the topic manager exists: it names the topics served here.
                self.clock_keeper = ClockKeeper(
                    store,
                    ownership,
                    lambda: [] if self.manager is None else self.manager.reliable_topics(),
                    interval=float(storage.clock_interval_seconds),
                )
        self.cleaner.start()
        if self.objects is not None:
            log.info("object store %s", self.objects.description)
        return manifest

    async def stop(self, grace: float = 5.0) -> None:
        """Shut down cleanly (see the module docs). Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.manager is not None:
            self.manager.end_streams()
        if self.clock_keeper is not None:
            await self.clock_keeper.stop()
        if self._server is not None:
            await self._server.stop(grace)
        if self._durable is not None:
            await self._durable.close()
        if self.manager is not None:
            await self.manager.close()
        if self._forwarder is not None:
            await self._forwarder.close()
        if self._progress is not None:
            await self._progress.close()
        if self.tail_handover is not None:
            await self.tail_handover.stop()
        if self.kafka_rescue is not None:
            await self.kafka_rescue.stop()
        if self.uploader is not None:
            await self.uploader.stop()
        if self.cleaner is not None:
            await self.cleaner.stop()
        if self._ownership is not None:
            await self._ownership.close()
        if self.store is not None:
            await self.store.close()
        if self.objects is not None:
            await self.objects.close()
        if self._session is not None:
            await self._session.close()
        if self._kv is not None and self._owns_kv:
            await self._kv.close()
        if self._lock is not None and self._owns_lock:
            self._lock.release()
        if self._http is not None:
            await self._http.stop()
        log.info("broker stopped broker_id=%s", self.config.broker.broker_id)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def data_dir(self) -> Path:
        return self.config.broker.data_dir
