"""Where a region's WAL lives in Kafka, and the checks made before anything is written there.

A region of the Kafka backend is two Kafka topics of one partition each (see
``docs/design/kafka_wal.md``):

* ``{prefix}{wal}.{region}``: the data topic. Record key = (segment seq, byte position),
  value = the WAL frames' bytes at that position (a chunk of the sequencer, cut into records of
  at most ``RECORD_BYTES``). A 1,000-message batch is one frame, so one record.
* ``{prefix}{wal}.{region}.meta``: the meta topic (compacted, one key): RegionMeta snapshots,
  each with the lowest segment still kept.

``wal`` names the WAL, not the machine: the broker id. A broker restarted with its data
directory wiped finds its region in Kafka again; two processes claiming one WAL fence each
other through the region's two transactional ids (``{prefix}{wal}.{region}`` and the same
with ``/2``: the writer alternates between them, see :mod:`danube_ingest.wal.kafka.backend`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from danube_ingest.errors import ConfigError

#: Kafka topic names: ASCII letters, digits, '.', '_' and '-', at most 249 characters.
_TOPIC_CHARS = re.compile(r"[^A-Za-z0-9._-]")
#: The largest record value written: below Kafka's default ``message.max.bytes`` (1 MiB), so
#: the WAL's topics need no special broker settings. Larger chunks become several records.
RECORD_BYTES = 512 * 1024
#: Replication factor when none is configured.
DEFAULT_REPLICATION_FACTOR = 3


def _safe(name: str) -> str:
    """``name`` as a part of a Kafka topic name (an unsafe name gets a short hash suffix so two
    names never collide after the replacement)."""
    cleaned = _TOPIC_CHARS.sub("_", name)
    if cleaned != name:
        cleaned += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return cleaned


#: Transactional producers per region. Kafka answers a transaction's commit before it has
#: written the commit markers; a new transaction of the same id that starts meanwhile gets
#: ``CONCURRENT_TRANSACTIONS``, which librdkafka retries after a fixed 20 ms. Alternating
#: between two ids lets the markers of one finish while the other commits.
TRANSACTIONAL_PRODUCERS = 2


@dataclass(frozen=True, slots=True)
class RegionTopics:
    """The Kafka names of one region."""

    data: str
    meta: str
    transactional_ids: tuple[str, ...]
    """The region's transactional ids: the first is the topic name, the others add ``/N``
    (a '/' never occurs in a topic name, so no other region's id can equal one of them)."""


@dataclass(frozen=True, slots=True)
class KafkaWal:
    """The Kafka backend's settings (``storage.wal.kafka``) and the WAL's name."""

    bootstrap_servers: str
    wal: str
    """The WAL's name (the broker id): part of every topic name and transactional id."""
    topic_prefix: str = "danube-wal."
    replication_factor: int | None = None
    """None: ``DEFAULT_REPLICATION_FACTOR``, refused on a smaller cluster."""
    min_insync_replicas: int | None = None
    """None: 2 when replicated at least 3 times, else 1."""
    delivery_timeout_ms: int = 10_000
    """Once Kafka has committed nothing for this long, new appends are refused
    (``WalStalledError``) until it commits again."""
    client: dict[str, Any] = field(default_factory=dict)
    """librdkafka settings passed through (``security.protocol``, ``ssl.*``, ``sasl.*``)."""

    def __post_init__(self) -> None:
        if not self.bootstrap_servers.strip():
            raise ConfigError("storage.wal.kafka.bootstrap_servers: must name at least one server")
        if self.replication_factor is not None and self.replication_factor < 1:
            raise ConfigError("storage.wal.kafka.replication_factor: must be >= 1")
        if self.min_insync_replicas is not None and not (
            1 <= self.min_insync_replicas <= self.replicas
        ):
            raise ConfigError(
                "storage.wal.kafka.min_insync_replicas: must be between 1 and the replication "
                f"factor ({self.replicas})"
            )
        for key in self.client:
            if key in _OWNED:
                raise ConfigError(
                    f"storage.wal.kafka.client.{key}: set by the WAL itself (it is what makes "
                    "an acknowledgement durable and fenced); remove it"
                )

    @property
    def replicas(self) -> int:
        return self.replication_factor or DEFAULT_REPLICATION_FACTOR

    @property
    def in_sync(self) -> int:
        if self.min_insync_replicas is not None:
            return self.min_insync_replicas
        return 2 if self.replicas >= 3 else 1

    def region(self, region: str) -> RegionTopics:
        base = f"{self.topic_prefix}{_safe(self.wal)}.{_safe(region)}"
        if len(base) + len(".meta") > 249:
            raise ConfigError(
                f"storage.wal.kafka.topic_prefix: the WAL topic name {base!r} is longer than "
                "Kafka allows (249 characters)"
            )
        ids = (base, *(f"{base}/{n}" for n in range(2, TRANSACTIONAL_PRODUCERS + 1)))
        return RegionTopics(data=base, meta=base + ".meta", transactional_ids=ids)

    def common(self) -> dict[str, Any]:
        """Settings every client of the WAL gets."""
        return {"bootstrap.servers": self.bootstrap_servers, "log_level": 0, **self.client}


#: Producer settings the WAL decides (a user's value would break durability or fencing).
_OWNED = frozenset(
    {
        "acks",
        "enable.idempotence",
        "transactional.id",
        "isolation.level",
        "enable.auto.commit",
        "bootstrap.servers",
    }
)
