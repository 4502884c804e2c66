"""The configuration models, one per YAML section, with documented defaults."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from danube_ingest.config.auth import AuthConfig
from danube_ingest.config.values import (
    GiB,
    KiB,
    MiB,
    _Bytes,
    _Count,
    _FieldError,
    _Millis,
    _Minutes,
    _OptionalBytes,
    _OptionalMinutes,
    _OptionalPath,
    _OptionalSecret,
    _OptionalStr,
    _Path,
    _Seconds,
    _Section,
    _WholeSeconds,
)
from danube_ingest.errors import ConfigError


class TlsConfig(_Section):
    """TLS on the gRPC port (``broker.tls``); off unless cert_file and key_file are set."""

    cert_file: _OptionalPath = Field(
        default=None,
        description=(
            "PEM certificate chain the broker presents (its subject alternative names must "
            "cover the host names clients connect to). Set with key_file to serve TLS only."
        ),
    )
    key_file: _OptionalPath = Field(
        default=None,
        description="PEM private key of cert_file. Keep it readable by the broker only.",
    )
    client_ca_file: _OptionalPath = Field(
        default=None,
        description=(
            "PEM CA certificates that client certificates are checked against (mutual TLS). "
            "Null: clients are not asked for a certificate."
        ),
    )
    require_client_cert: bool = Field(
        default=False,
        description=(
            "Refuse clients without a certificate signed by client_ca_file (mutual TLS). "
            "False: clients are asked for a certificate but accepted without one, and gRPC "
            "does not verify one they send; never trust its identity then."
        ),
    )

    @property
    def enabled(self) -> bool:
        """Whether the gRPC port serves TLS."""
        return self.cert_file is not None

    @model_validator(mode="after")
    def _check_pairs(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            raise _FieldError(missing, "cert_file and key_file go together: set both or neither")
        if self.client_ca_file is not None and not self.enabled:
            raise _FieldError("client_ca_file", "needs cert_file and key_file (TLS) as well")
        if self.require_client_cert and self.client_ca_file is None:
            raise _FieldError("require_client_cert", "needs client_ca_file")
        return self


class BrokerSection(_Section):
    """Identity and addresses of this broker."""

    broker_id: str = Field(
        default="broker-1",
        description=(
            "Unique id of this broker in the cluster. It names the broker's etcd keys "
            "(`brokers/{id}`) and its segment objects (`segments/{id}/...`), so it must not "
            "change across restarts. Letters, digits, '.', '_' and '-'."
        ),
    )
    listen: str = Field(
        default="127.0.0.1:6650",
        description=(
            "Address the Danube gRPC server binds, as host:port (IPv6 as [addr]:port). "
            "Port 0 picks a free port. 6650 is Danube's client port."
        ),
    )
    advertised_url: _OptionalStr = Field(
        default=None,
        description=(
            "Address clients are sent to when a topic lookup redirects them to this broker, "
            "e.g. behind a proxy or in Kubernetes. Unset (null): the listen address."
        ),
    )
    data_dir: _Path = Field(
        default=Path("./data"),
        description=(
            "Directory for this broker's local state: the WAL (`{data_dir}/wal` unless "
            "storage.wal.dir is set) and, with the fs backend, objects (`{data_dir}/objects` "
            "unless storage.cloud.root is set). One process at a time: the broker holds "
            "`{data_dir}/LOCK` (and the WAL directory's) while it runs, and a second one fails "
            "at once naming its pid. `{data_dir}/ID` identifies the directory; "
            "`{data_dir}/METADATA` records the metadata store it belongs to (etcd's cluster id "
            "and etcd.prefix, or memory), and a broker configured with another one stops "
            "naming both. Local disk only."
        ),
    )

    tls: TlsConfig = Field(
        default_factory=TlsConfig, description="TLS (and mutual TLS) on the gRPC port."
    )
    allow_insecure: bool = Field(
        default=False,
        description=(
            "Serve plain (unencrypted) gRPC on a listen address that is not loopback. Without "
            "it such a broker refuses to start unless broker.tls is set; loopback addresses "
            "(127.0.0.0/8, ::1, localhost) serve plain gRPC by default."
        ),
    )

    @field_validator("broker_id")
    @classmethod
    def _check_broker_id(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
            raise ConfigError(
                f"must be letters, digits, '.', '_' or '-', starting with a letter or digit "
                f"(got {value!r})"
            )
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"must be host:port with a port from 0 to 65535 (got {value!r})")
        return value


class RetentionConfig(_Section):
    """How much WAL is kept on local disk. Pruning never removes data that is not uploaded."""

    min_minutes: _Minutes = Field(
        default=0,
        ge=0,
        description=(
            "Keep WAL data at least this long, even once it is uploaded and consumed, so readers "
            "that rewind read local files rather than objects. 0: prune as soon as allowed."
        ),
    )
    min_bytes: _Bytes = Field(
        default=0,
        ge=0,
        description="Keep at least this many bytes of the newest WAL data, however old.",
    )
    max_minutes: _OptionalMinutes = Field(
        default=None,
        gt=0,
        description=(
            "Data older than this is prunable once uploaded, even if a subscription has not "
            "consumed it yet (that subscription then reads from objects). "
            "Null: only consumed data is pruned."
        ),
    )
    max_bytes: _Bytes = Field(
        default=1 * GiB,
        gt=0,
        description=(
            "Most bytes of WAL on disk, all regions together. Where pruning is allowed, the "
            "cleaner prunes from four segments below it (a quarter of it at most), so that "
            "publishes seldom find it full; when it is full, publishes fail with a retriable "
            "backpressure error until uploads and pruning free space."
        ),
    )
    min_free_bytes: _Bytes = Field(
        default=64 * MiB,
        ge=0,
        description=(
            "Free-space floor of the WAL's filesystem. Publishes that would leave less free "
            "fail with a retriable backpressure error (RESOURCE_EXHAUSTED) before any write can "
            "fail, and succeed again once a quarter of it is free above it; below it the "
            "cleaner prunes as over max_bytes, segment preallocation is skipped, and an fs "
            "object store refuses "
            "(retriably) PUTs that would leave less than half of it free. Keep it at least "
            "2 x (segment_bytes + max_batch_bytes). 0: no floor (a full disk then fails the "
            "WAL until restart)."
        ),
    )

    check_seconds: _Seconds = Field(
        default=5,
        gt=0,
        description=(
            "Seconds between two passes of the WAL cleaner (a pass also follows every upload)."
        ),
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> RetentionConfig:
        if self.min_bytes > self.max_bytes:
            raise _FieldError("min_bytes", f"must be <= max_bytes ({self.max_bytes})")
        if self.max_minutes is not None and self.min_minutes > self.max_minutes:
            raise _FieldError("min_minutes", f"must be <= max_minutes ({self.max_minutes})")
        return self


class KafkaWalConfig(_Section):
    """The WAL on Apache Kafka (``storage.wal.backend: kafka``): each region is a data topic
    and a meta topic of one partition; appends are acknowledged once a Kafka transaction holding
    them is committed (``acks=all``)."""

    bootstrap_servers: str = Field(
        default="",
        description=(
            "Kafka bootstrap servers, comma-separated host:port. Required with backend kafka."
        ),
    )
    topic_prefix: str = Field(
        default="danube-wal.",
        pattern=r"^[A-Za-z0-9._-]{0,100}$",
        description=(
            "Prefix of the WAL's Kafka topic names (`{prefix}{broker id}.{region}` and "
            "`.meta`) and transactional ids. Letters, digits, '.', '_' and '-'."
        ),
    )
    replication_factor: _Count | None = Field(
        default=None,
        ge=1,
        description=(
            "Replicas of each WAL topic. Null: 3, refused on a cluster of fewer brokers "
            "(set it explicitly to run on one or two)."
        ),
    )
    min_insync_replicas: _Count | None = Field(
        default=None,
        ge=1,
        description=(
            "Kafka's min.insync.replicas of the WAL topics: an append is acknowledged once this "
            "many replicas hold it. Null: 2 with 3 or more replicas, else 1."
        ),
    )
    delivery_timeout_ms: _Millis = Field(
        default=10_000,
        ge=1000,
        description=(
            "Once Kafka has committed none of the WAL's appends for this long, new appends are "
            "refused (RESOURCE_EXHAUSTED, retriable) until it commits again; appends staged "
            "before wait for Kafka and are acknowledged once it holds them."
        ),
    )
    client: dict[str, str | int | bool] = Field(
        default_factory=dict,
        description=(
            "librdkafka settings passed to every Kafka client of the WAL: security.protocol, "
            "ssl.*, sasl.* ... Not acks, enable.idempotence, transactional.id, isolation.level."
        ),
    )


class WalConfig(_Section):
    """The write-ahead log: region logs of segment files, group-committed with fdatasync."""

    backend: Literal["local", "kafka"] = Field(
        default="local",
        description=(
            "'local': segment files on this machine's disk, synced (fdatasync). 'kafka': the "
            "log is in Apache Kafka (storage.wal.kafka); the WAL directory is only its cache, "
            "so an acknowledged message survives the loss of this machine."
        ),
    )
    kafka: KafkaWalConfig = Field(
        default_factory=KafkaWalConfig, description="The Kafka backend (backend: kafka)."
    )
    dir: _OptionalPath = Field(
        default=None,
        description="WAL directory. Null: `{broker.data_dir}/wal`. Use a fast local disk.",
    )
    fsync: Literal["always", "never"] = Field(
        default="always",
        description=(
            "'always': a reliable publish is acknowledged only after its WAL frame is on disk "
            "(fdatasync, group commit). 'never': acknowledge after write(), never sync; data in "
            "the page cache is lost if the machine crashes. For benchmarks only."
        ),
    )
    fsync_interval_ms: _Millis = Field(
        default=0,
        ge=0,
        description=(
            "Time the writer always lingers to gather a bigger batch before writing and syncing "
            "it, whatever the load (see linger_us for the adaptive wait). 0: flush as soon as the "
            "writer is idle (appends that arrive during a sync still share the next one)."
        ),
    )
    linger_us: int = Field(
        default=1000,
        ge=0,
        le=1_000_000,
        description=(
            "Adaptive group commit, in microseconds: while small appends keep arriving during "
            "each write and fdatasync (many producers at once, at least two appends per "
            "linger_us), the writer waits up to this long for more to share the next one; it "
            "stops early once the stream pauses or the batch reaches 64KiB. An append that "
            "nothing else arrives beside (one publish in flight) is never delayed. 0: never wait."
        ),
    )
    max_batch_bytes: _Bytes = Field(
        default=4 * MiB,
        gt=0,
        description="Most bytes written with one write() and synced with one fdatasync.",
    )
    segment_bytes: _Bytes = Field(
        default=8 * MiB,
        ge=64 * KiB,
        description=(
            "Seal the active segment file once it reaches this size. Each sealed segment becomes "
            "one object (one PUT). At least 64KiB."
        ),
    )
    segment_seconds: _Seconds = Field(
        default=10.0,
        gt=0,
        description=(
            "Seal the active segment once it is this old, even if no more appends arrive; "
            "bounds how far the object store lags behind the WAL."
        ),
    )
    index_interval_bytes: _Bytes = Field(
        default=64 * KiB,
        gt=0,
        description=(
            "Bytes of log between two entries of a topic's offset index. Smaller: shorter scans "
            "when a reader seeks; larger: smaller index and RegionMeta snapshots."
        ),
    )
    regions: _Count = Field(
        default=1,
        ge=1,
        description=(
            "Number of region logs; topics are spread over them by name. Each region has its own "
            "writer and fsync; with one region a single fsync covers every topic."
        ),
    )
    snapshot_on_seal: bool = Field(
        default=True,
        description=(
            "Snapshot RegionMeta (per-topic offsets and index) every time a segment is sealed, "
            "so recovery only scans the log written after the last seal."
        ),
    )
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="Local WAL retention (pruning of segment files).",
    )

    @model_validator(mode="after")
    def _check_retention(self) -> WalConfig:
        if self.backend == "kafka" and not self.kafka.bootstrap_servers.strip():
            raise _FieldError("kafka.bootstrap_servers", "required with backend 'kafka'")
        if self.retention.max_bytes < self.segment_bytes:
            raise _FieldError(
                "retention.max_bytes", f"must be >= segment_bytes ({self.segment_bytes})"
            )
        return self


class CacheConfig(_Section):
    """In-memory cache of recently appended entries, read before WAL files and objects."""

    max_bytes: _Bytes = Field(
        default=256 * MiB,
        gt=0,
        description="Most bytes of entries cached in memory, all topics together.",
    )
    topic_max_bytes: _Bytes = Field(
        default=8 * MiB,
        gt=0,
        description="Most bytes of entries cached for one topic. At most max_bytes.",
    )

    @model_validator(mode="after")
    def _check_topic_max(self) -> CacheConfig:
        if self.topic_max_bytes > self.max_bytes:
            raise _FieldError("topic_max_bytes", f"must be <= max_bytes ({self.max_bytes})")
        return self


#: Below this, one 8 MiB segment takes over 8 s to ship: a value this small is a unit mistake
#: (bytes meant as KiB or MiB) far more often than a real link.
MIN_UPLOAD_BYTES_PER_SECOND = MiB


class UploaderConfig(_Section):
    """Ships each sealed segment to the object store as one object, then records it in etcd."""

    enabled: bool = Field(
        default=True,
        description=(
            "Upload sealed segments (mode wal_cloud only). Off: data stays only in the WAL and, "
            "never being uploaded, is never pruned."
        ),
    )
    concurrency: _Count = Field(
        default=4,
        ge=1,
        description="Segment uploads in flight at once.",
    )
    max_bytes_per_second: _OptionalBytes = Field(
        default=None,
        description=(
            "Upload bandwidth of the broker, shared by all uploads in flight (e.g. 50MiB; "
            "at least 1MiB). Objects are streamed in paced chunks, so a catch-up of a large "
            "WAL backlog leaves the link and CPU to live publishes. null: no limit. A limit "
            "below the broker's ingest rate makes the WAL grow until publishes get "
            "backpressure."
        ),
    )
    max_retries: _Count = Field(
        default=10,
        ge=0,
        description=(
            "Retries of one upload (PUT or manifest commit) before it is reported as failed. "
            "A segment that is not uploaded is never pruned."
        ),
    )
    retry_base_ms: _Millis = Field(
        default=100,
        gt=0,
        description="Delay before the first retry; it doubles on each further retry.",
    )
    retry_max_ms: _Millis = Field(
        default=10_000,
        gt=0,
        description="Longest delay between two retries. At least retry_base_ms.",
    )
    handover_check_seconds: _Seconds = Field(
        default=1,
        gt=0,
        description=(
            "Seconds between two looks for topics taken over from this broker whose new owner "
            "waits for its unuploaded WAL tail (also looked at on start and when a topic is "
            "lost): the new owner's clients get UNAVAILABLE until then."
        ),
    )
    shutdown_upload_seconds: _Seconds = Field(
        default=10,
        ge=0,
        description=(
            "A clean shutdown waits at most this long for the WAL tails of the topics served "
            "here to be uploaded, so that their next owners continue at once. A tail not "
            "uploaded by then waits for this broker's restart (or 'brokers forget'). Keep it "
            "below the supervisor's SIGTERM-to-SIGKILL time."
        ),
    )

    @field_validator("max_bytes_per_second")
    @classmethod
    def _check_bandwidth(cls, value: int | None) -> int | None:
        if value is not None and value < MIN_UPLOAD_BYTES_PER_SECOND:
            raise ConfigError(
                f"must be at least 1MiB ({MIN_UPLOAD_BYTES_PER_SECOND} bytes per second), or "
                f"null for no limit (got {value})"
            )
        return value

    @model_validator(mode="after")
    def _check_backoff(self) -> UploaderConfig:
        if self.retry_max_ms < self.retry_base_ms:
            raise _FieldError("retry_max_ms", f"must be >= retry_base_ms ({self.retry_base_ms})")
        return self


def _option_text(value: object) -> object:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


# Keys opendal takes that have their own field here; setting them in options would be ambiguous.
_DEDICATED_CLOUD_KEYS = (
    "root",
    "bucket",
    "endpoint",
    "region",
    "access_key_id",
    "secret_access_key",
)


class CloudConfig(_Section):
    """Object store (through opendal) that holds segment and topic objects."""

    backend: Literal["fs", "memory", "s3", "gcs"] = Field(
        default="fs",
        description=(
            "'fs': a local or shared directory; 'memory': in-process, lost on exit (tests); "
            "'s3': S3 or an S3-compatible server; 'gcs': Google Cloud Storage."
        ),
    )
    root: str = Field(
        default="",
        description=(
            "Prefix of every object key: a directory for fs (empty: `{broker.data_dir}/objects`), "
            "a path inside the bucket for s3 and gcs (empty: the bucket's root). Brokers that "
            "share a cluster must share the root."
        ),
    )
    bucket: _OptionalStr = Field(
        default=None,
        description="Bucket name. Required for s3 and gcs.",
    )
    endpoint: _OptionalStr = Field(
        default=None,
        description=(
            "Service URL, for S3-compatible servers (MinIO, moto) or emulators, e.g. "
            "http://127.0.0.1:9000. Null: the provider's default endpoint."
        ),
    )
    region: _OptionalStr = Field(
        default=None,
        description="Bucket region, e.g. us-east-1. Required for s3.",
    )
    access_key_id: _OptionalStr = Field(
        default=None,
        description=(
            "S3 access key id, usually `${AWS_ACCESS_KEY_ID}`. "
            "Null: opendal's default credential chain (environment, profile, instance role)."
        ),
    )
    secret_access_key: _OptionalSecret = Field(
        default=None,
        description=(
            "S3 secret access key, usually `${AWS_SECRET_ACCESS_KEY}`. Never printed in logs "
            "or errors. Null: opendal's default credential chain."
        ),
    )
    compression: Literal["none", "zstd", "lz4"] = Field(
        default="zstd",
        description="Compression of the frames in objects written by this broker.",
    )
    options: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Further opendal options for the backend, passed as is, e.g. "
            "`{enable_virtual_host_style: 'true'}` for s3 or `{credential_path: ...}` for gcs."
        ),
    )

    @field_validator("options", mode="before")
    @classmethod
    def _stringify_options(cls, value: object) -> object:
        # opendal takes every option as a string; YAML turns `true` and `8` into bool and int.
        if not isinstance(value, Mapping):
            return value
        return {key: _option_text(item) for key, item in value.items()}

    @model_validator(mode="after")
    def _check_backend(self) -> CloudConfig:
        for key in _DEDICATED_CLOUD_KEYS:
            if key in self.options:
                raise _FieldError(f"options.{key}", f"set storage.cloud.{key} instead")
        if self.backend in ("s3", "gcs") and self.bucket is None:
            raise _FieldError("bucket", f"is required when backend is {self.backend!r}")
        if self.backend == "s3" and self.region is None:
            raise _FieldError("region", "is required when backend is 's3'")
        if self.backend == "s3":
            _check_s3_encryption(self.options)
        return self


#: S3's server-side encryption modes (opendal passes the value through; S3 refuses others
#: only when an object is written, and moto not at all).
_SSE_MODES = ("AES256", "aws:kms", "aws:kms:dsse")


def _check_s3_encryption(options: Mapping[str, str]) -> None:
    """Refuse s3 encryption options that S3 would refuse at the first PUT, or ignore."""
    mode = options.get("server_side_encryption")
    if mode is not None and mode not in _SSE_MODES:
        raise _FieldError(
            "options.server_side_encryption",
            f"must be one of {', '.join(_SSE_MODES)} (got {mode!r})",
        )
    if "server_side_encryption_aws_kms_key_id" in options and not (mode or "").startswith(
        "aws:kms"
    ):
        raise _FieldError(
            "options.server_side_encryption_aws_kms_key_id",
            "is ignored unless server_side_encryption is aws:kms: set that too",
        )
    customer = [key for key in options if key.startswith("server_side_encryption_customer_")]
    if customer:
        if mode is not None:
            raise _FieldError(
                "options.server_side_encryption",
                "customer keys (server_side_encryption_customer_*) replace it: set one or "
                "the other",
            )
        if options.get("server_side_encryption_customer_algorithm") != "AES256":
            raise _FieldError(
                "options.server_side_encryption_customer_algorithm",
                "must be AES256 when a customer key is given",
            )
        if "server_side_encryption_customer_key" not in options:
            raise _FieldError(
                "options.server_side_encryption_customer_key",
                "is required with server_side_encryption_customer_algorithm (base64 of 32 bytes)",
            )


class RotationConfig(_Section):
    """Rotation (Dagster job ``rotate_topics``): merges a topic's small ranges into rolling
    per-topic objects ``topics/{ns}/{topic}/data-{epoch}-{start}-{end}.bin``."""

    max_object_bytes: _Bytes = Field(
        default=128 * MiB,
        ge=1 * MiB,
        description=(
            "Most stored bytes of input merged into one rolling topic object. A topic object "
            "of at least half this size is never merged again."
        ),
    )
    max_object_seconds: _Seconds = Field(
        default=3600,
        gt=0,
        description=(
            "Most ingest time one rolling topic object spans (first to last entry). The "
            "newest ranges of a topic are merged once this much older than their first entry, "
            "or once the next ranges fill an object."
        ),
    )
    min_ranges: _Count = Field(
        default=2,
        ge=2,
        le=60,
        description=(
            "Fewest ranges worth merging into one object (at most 60 are merged at once: etcd "
            "allows 128 operations per transaction and each range costs two)."
        ),
    )
    sensor_min_ranges: _Count = Field(
        default=2,
        ge=2,
        description=(
            "The rotation sensor requests a run for a topic once a run would merge at least "
            "this many of its ranges (ranges of groups that are full, or old enough)."
        ),
    )


class StorageConfig(_Section):
    """Where published data lives: WAL first, the object store behind it."""

    mode: Literal["wal_cloud", "local_only", "memory"] = Field(
        default="wal_cloud",
        description=(
            "'wal_cloud': WAL on local disk, sealed segments uploaded to the object store. "
            "'local_only': WAL only; uploader and cloud are not used. "
            "'memory': nothing on disk, nothing durable (tests and benchmarks)."
        ),
    )
    wal: WalConfig = Field(default_factory=WalConfig, description="Write-ahead log.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Entry cache.")
    uploader: UploaderConfig = Field(
        default_factory=UploaderConfig, description="Segment uploader."
    )
    cloud: CloudConfig = Field(default_factory=CloudConfig, description="Object store.")
    rotation: RotationConfig = Field(
        default_factory=RotationConfig, description="Rotation into rolling topic objects."
    )
    clock_interval_seconds: _Seconds = Field(
        default=10.0,
        ge=0,
        description=(
            "Seconds between two advances of each owned reliable topic's ingest clock "
            "(etcd storage/topics/{ns}/{topic}/clock, read by the Parquet converter): a "
            "durable time marker per topic, then one clock write per topic whose offsets "
            "below it are uploaded. An idle topic's clock passes an instant within about this "
            "long; a busy topic's also waits for wal.segment_seconds and the upload. "
            "0: no clock (mode wal_cloud with the uploader only)."
        ),
    )


class LimitsConfig(_Section):
    """Limits the broker enforces on clients."""

    max_payload_bytes: _Bytes = Field(
        # gRPC's default maximum message is 4MiB (4,194,304 bytes); 4,000,000 leaves ~190KB
        # for the rest of the request (topic and subscription names, protobuf framing). The
        # attributes, routing key and producer name count against it too (broker.validation):
        # otherwise 64 attributes of 200KB each would pass, and the delivered message would
        # exceed the broker's send limit.
        default=4_000_000,
        gt=0,
        description=(
            "Largest message accepted: its payload, attribute keys and values, routing key and "
            "producer name together (UTF-8 bytes); larger publishes are rejected with "
            "INVALID_ARGUMENT. The default stays under gRPC's 4MiB message limit."
        ),
    )
    max_attributes: _Count = Field(
        default=64,
        ge=0,
        description="Most attributes (string key/value pairs) on one message.",
    )
    max_producers_per_topic: _Count = Field(
        default=1000,
        ge=1,
        description="Most producers connected to one topic at once.",
    )
    max_publish_streams: _Count = Field(
        default=1000,
        ge=1,
        description=(
            "Most batch-path Publish streams (one per danube_ingest.client.Producer) served at "
            "once; one more is refused with RESOURCE_EXHAUSTED before any of its batches is "
            "read, and the Producer retries it with backoff and the same sequences."
        ),
    )
    max_consumers_per_subscription: _Count = Field(
        default=1000,
        ge=1,
        description="Most consumers attached to one subscription at once.",
    )
    max_unacked_messages: _Count = Field(
        default=1000,
        ge=1,
        description=(
            "Most messages delivered to one consumer and not yet acked; dispatch to that "
            "consumer pauses when it is reached."
        ),
    )


class DispatchConfig(_Section):
    """Reliable dispatch: acknowledgement, redelivery and poison messages (per subscription)."""

    ack_timeout_seconds: _Seconds = Field(
        default=30.0,
        gt=0,
        description="A delivered message not acked within this time is redelivered.",
    )
    nack_base_delay_ms: _Millis = Field(
        default=1000,
        ge=0,
        description=(
            "Least delay before a nacked message is redelivered (a nack may ask for more)."
        ),
    )
    redelivery_base_ms: _Millis = Field(
        default=1000,
        gt=0,
        description="Redelivery backoff after the first failed delivery; doubles each time.",
    )
    redelivery_max_ms: _Millis = Field(
        default=60000,
        gt=0,
        description="Longest redelivery backoff (also caps nack delays).",
    )
    max_redeliveries: _Count = Field(
        default=5,
        ge=0,
        description="Redeliveries of one message before the poison policy applies.",
    )
    poison_policy: Literal["block", "drop", "dead_letter"] = Field(
        default="block",
        description=(
            "What happens after the last redelivery failed: 'block' keeps redelivering it and "
            "holds back new messages of that subscription; 'drop' skips it (logged); "
            "'dead_letter' republishes it to dead_letter_topic with x-original-* attributes."
        ),
    )
    consumer_idle_seconds: _Seconds = Field(
        default=30.0,
        gt=0,
        description=(
            "A consumer that subscribed but has neither a message stream open nor health-checked "
            "(every 5 s) for this long is detached: it no longer holds an Exclusive "
            "subscription or a Failover's active place. It re-attaches when it comes back."
        ),
    )
    dead_letter_topic: str = Field(
        default="{topic}-dlq",
        description="Dead-letter topic name; '{topic}' is replaced by the source topic's name.",
    )


class EtcdConfig(_Section):
    """The etcd cluster holding metadata: ownership, manifests, cursors, prune marks."""

    endpoints: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:2379"],
        min_length=1,
        description=(
            "etcd client URLs. A single string is split on commas, so one environment "
            "variable can carry the whole list."
        ),
    )
    prefix: str = Field(
        default="/danube",
        description="Prefix of every key this broker reads or writes. Starts with '/'.",
    )
    lease_ttl_seconds: _WholeSeconds = Field(
        default=10,
        ge=1,
        description=(
            "TTL of the broker's lease. Its registration and topic ownership lapse this long "
            "after it stops renewing (crash, partition), so other brokers can take over. The "
            "same broker restarted on the same data_dir takes them back at once."
        ),
    )
    connect_timeout_seconds: _Seconds = Field(
        default=5.0,
        gt=0,
        description="How long to wait for etcd to answer when connecting.",
    )
    ca_file: _OptionalPath = Field(
        default=None,
        description=(
            "PEM CA certificates etcd's server certificate is checked against, for `https://` "
            "endpoints. Null: the system's trusted roots."
        ),
    )
    cert_file: _OptionalPath = Field(
        default=None,
        description="PEM client certificate for etcd (`--client-cert-auth`); needs key_file.",
    )
    key_file: _OptionalPath = Field(default=None, description="PEM private key of cert_file.")
    user: _OptionalStr = Field(
        default=None,
        description="etcd user name (etcd auth enabled); needs password or password_file.",
    )
    password: _OptionalSecret = Field(
        default=None,
        description="Password of user, usually `${ETCD_PASSWORD}`. Never printed.",
    )
    password_file: _OptionalPath = Field(
        default=None,
        description="File holding the password of user (trailing newline ignored).",
    )

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split_endpoints(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not value.startswith("/") or len(value) < 2 or value.endswith("/"):
            raise ConfigError(f"must start with '/' and not end with '/' (got {value!r})")
        return value

    @model_validator(mode="after")
    def _check_security(self) -> EtcdConfig:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            raise _FieldError(missing, "cert_file and key_file go together: set both or neither")
        if self.password is not None and self.password_file is not None:
            raise _FieldError("password_file", "set password or password_file, not both")
        has_password = self.password is not None or self.password_file is not None
        if (self.user is None) == has_password:
            missing = "user" if self.user is None else "password"
            raise _FieldError(missing, "user and password (or password_file) go together")
        plain = [e for e in self.endpoints if e != "memory" and not e.startswith("https://")]
        uses_tls = self.ca_file is not None or self.cert_file is not None
        if uses_tls and plain:
            raise _FieldError(
                "endpoints",
                f"ca_file / cert_file are set but {plain[0]!r} is not https://: use "
                "https:// endpoints for an etcd with TLS",
            )
        return self


#: ``metrics.listen: auto`` serves metrics on the broker's listen port plus this: Danube's 6650
#: gives 9650, the metrics port of earlier versions, and a second broker on 6651 gets 9651.
METRICS_PORT_OFFSET = 3000


class MetricsConfig(_Section):
    """The HTTP port for Prometheus metrics and health probes."""

    listen: str = Field(
        default="auto",
        description=(
            "Address of the HTTP server for `/metrics` (Prometheus text format), `/healthz` "
            "and `/readyz`, as host:port (IPv6 as [addr]:port); port 0 picks a free port; "
            "`off` serves none of them. `auto`: 127.0.0.1 on broker.listen's port + 3000 "
            "(6650 gives 9650, 6651 gives 9651), so brokers on one host that differ in their "
            "listen port differ in their metrics port too; a free port when that is past 65535 "
            "or the listen port is 0. A port in use stops the broker at start-up."
        ),
    )
    max_lag_series: _Count = Field(
        default=100,
        ge=0,
        description=(
            "Most subscriptions with their own `danube_ingest_subscription_lag_messages` "
            "series (those with the largest lag); the others' lag is summed in "
            "`danube_ingest_subscription_lag_other_messages`."
        ),
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        if value in ("off", "auto"):
            return value
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(
                f"must be host:port with a port from 0 to 65535, auto or off (got {value!r})"
            )
        return value


class IcebergConfig(_Section):
    """The Iceberg catalog the topics' tables are published in (docs/iceberg.md)."""

    catalog: Literal["sql", "rest", "off"] = Field(
        default="sql",
        description=(
            "`sql`: a SQL catalog (pyiceberg's SqlCatalog; Spark reaches the same tables "
            "through Iceberg's JDBC catalog) in the database `uri` names; `rest`: an Iceberg "
            "REST catalog at `uri`; `off`: tables stay plain Parquet (no catalog)."
        ),
    )
    name: str = Field(
        default="danube",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
        description=(
            "The catalog's name: tables are `<name>.<namespace>.<topic>` in Spark SQL "
            "(`danube.default.orders` for the topic `/default/orders`)."
        ),
    )
    uri: str = Field(
        default="",
        description=(
            "`sql`: a SQLAlchemy URL (`sqlite:////abs/catalog.db`, "
            "`postgresql+psycopg://user@host:5432/db`); empty: "
            "`sqlite:///{broker.data_dir}/iceberg/catalog.db`. `rest`: the REST catalog's "
            "http(s) URL (required). Passwords go in the environment (`${ENV}`), never here "
            "in the clear."
        ),
    )
    warehouse: str = Field(
        default="",
        description=(
            "Where new tables' Iceberg metadata goes, as a URI; empty: `iceberg/` in the "
            "object store beside the Parquet warehouse (`file://{objects root}/iceberg` on "
            "fs, `s3://{bucket}/{root}/iceberg` on s3)."
        ),
    )
    properties: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Further catalog properties, given to pyiceberg and to Spark's catalog "
            "(`spark.sql.catalog.<name>.<key>`), e.g. `s3.endpoint` or a REST catalog's "
            "`credential`."
        ),
    )
    tail_step_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description=(
            "The tail's step: the Dagster sensor `iceberg_tail_sensor` (and `danube-ingest "
            "tables follow`) appends the entries past the committed partitions up to the last "
            "multiple of this the topic clock has passed, so a table trails its topic by about "
            "this plus the clock's own lag (docs/iceberg.md#freshness); 0: no tail (tables show "
            "complete partitions only)."
        ),
    )
    dead_letters: Literal["keep", "table"] = Field(
        default="keep",
        description=(
            "Rows whose payload does not decode: `keep` them in the topic's table (raw "
            "`payload`, null decoded columns, the reason in `decode_error`); `table`: in a "
            "table of their own, `<topic>__dlq` (same columns but the decoded ones), so the "
            "topic's table holds only rows that decoded. Fixed per rendition when it is created "
            "(the table's first conversion, or `tables rendition`) (docs/iceberg.md#dead-letters)."
        ),
    )

    @model_validator(mode="after")
    def _check_uri(self) -> IcebergConfig:
        if self.catalog == "rest" and not self.uri.startswith(("http://", "https://")):
            raise _FieldError("uri", "catalog 'rest' needs the REST catalog's http(s) URL")
        return self


class BrokerConfig(_Section):
    """The whole configuration of one broker (one YAML file)."""

    broker: BrokerSection = Field(
        default_factory=BrokerSection, description="Identity and addresses."
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="WAL, cache, uploader and object store."
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Client limits.")
    dispatch: DispatchConfig = Field(
        default_factory=DispatchConfig, description="Acks, redelivery, poison messages."
    )
    etcd: EtcdConfig = Field(default_factory=EtcdConfig, description="Metadata store.")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Metrics and health endpoints."
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="Authentication and permissions."
    )
    iceberg: IcebergConfig = Field(
        default_factory=IcebergConfig, description="The catalog of the topics' tables."
    )

    def metrics_listen(self) -> str:
        """Where the metrics port binds: metrics.listen as configured (host:port or `off`),
        with `auto` resolved from broker.listen (port + ``METRICS_PORT_OFFSET`` on 127.0.0.1,
        port 0 when that does not fit)."""
        listen = self.metrics.listen
        if listen != "auto":
            return listen
        port = int(self.broker.listen.rpartition(":")[2]) + METRICS_PORT_OFFSET
        return f"127.0.0.1:{port if METRICS_PORT_OFFSET < port <= 65535 else 0}"

    def wal_dir(self) -> Path:
        """The WAL directory: storage.wal.dir, or `{broker.data_dir}/wal` when that is unset."""
        if self.storage.wal.dir is not None:
            return self.storage.wal.dir
        return self.broker.data_dir / "wal"

    def objects_root(self) -> str:
        """The opendal root: storage.cloud.root, or `{broker.data_dir}/objects` for an fs
        backend whose root is empty."""
        cloud = self.storage.cloud
        if cloud.backend != "fs":
            return cloud.root
        if not cloud.root:
            return str(self.broker.data_dir / "objects")
        return str(Path(cloud.root).expanduser())
