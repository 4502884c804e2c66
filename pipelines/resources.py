"""Dagster resources of the control plane: the etcd cluster the brokers share."""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dagster import ConfigurableResource

from danube_ingest.metadata import EtcdKV, Keys

#: Environment variables naming the etcd cluster (as the broker's ``etcd:`` section does);
#: ``danube-ingest dev`` sets them for the Dagster processes it starts.
ENDPOINTS_ENV = "DANUBE_INGEST_ETCD_ENDPOINTS"
PREFIX_ENV = "DANUBE_INGEST_ETCD_PREFIX"


class EtcdResource(ConfigurableResource):  # type: ignore[type-arg]
    """Where the brokers keep their metadata. Each run connects afresh and reads etcd itself."""

    endpoints: str = "http://127.0.0.1:2379"
    """Comma-separated etcd client URLs."""
    prefix: str = "/danube"
    """Key prefix (``etcd.prefix`` of the brokers)."""
    connect_timeout_seconds: float = 5.0

    @classmethod
    def from_env(cls) -> "EtcdResource":
        """Endpoints and prefix from the environment, with the broker's defaults."""
        return cls(
            endpoints=os.environ.get(ENDPOINTS_ENV, cls.model_fields["endpoints"].default),
            prefix=os.environ.get(PREFIX_ENV, cls.model_fields["prefix"].default),
        )

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[tuple[EtcdKV, Keys]]:
        """A connected client and the key layout; ``MetadataUnavailableError`` if unreachable."""
        endpoints = [e.strip() for e in self.endpoints.split(",") if e.strip()]
        kv = await EtcdKV.connect(endpoints, timeout=self.connect_timeout_seconds)
        try:
            yield kv, Keys(self.prefix)
        finally:
            await kv.close()
