"""Dagster resources of the control plane: the etcd cluster the brokers share, their object
store (and the Parquet warehouse in it), and how the conversion program is started."""

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dagster import ConfigurableResource

from danube_ingest.config.loader import CONFIG_ENV, DATA_DIR_ENV, load_config
from danube_ingest.config.models import BrokerConfig
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.etcd_security import ENV as ETCD_ENV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.objects.store import ObjectStore

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
    ca_file: str = ""
    """CA of etcd's certificate for https:// endpoints (etcd.ca_file); empty: system roots."""
    cert_file: str = ""
    """Client certificate (etcd.cert_file); empty: none."""
    key_file: str = ""
    """Its key (etcd.key_file)."""
    user: str = ""
    """etcd user (etcd.user); empty: no auth. The password is never part of the resource:
    it comes from ``password_file`` or the ``DANUBE_INGEST_ETCD_PASSWORD`` variable."""
    password_file: str = ""
    """File holding the user's password (etcd.password_file)."""

    def _security_env(self) -> dict[str, str]:
        env = {
            ETCD_ENV["ca_file"]: self.ca_file,
            ETCD_ENV["cert_file"]: self.cert_file,
            ETCD_ENV["key_file"]: self.key_file,
            ETCD_ENV["user"]: self.user,
            ETCD_ENV["password_file"]: self.password_file,
        }
        password = os.environ.get(ETCD_ENV["password"])
        if password:
            env[ETCD_ENV["password"]] = password
        return {name: value for name, value in env.items() if value}

    def child_env(self) -> dict[str, str]:
        """The environment that gives a child process (the Spark job) the same cluster,
        credentials included."""
        return {ENDPOINTS_ENV: self.endpoints, PREFIX_ENV: self.prefix, **self._security_env()}

    def security(self) -> EtcdSecurity:
        """TLS files and user of this resource (reads the password file now)."""
        return EtcdSecurity.from_env(self._security_env())

    @classmethod
    def from_env(cls) -> "EtcdResource":
        """Endpoints, prefix and security from the environment (``DANUBE_INGEST_ETCD_*``),
        with the broker's defaults."""
        return cls(
            endpoints=os.environ.get(ENDPOINTS_ENV, cls.model_fields["endpoints"].default),
            prefix=os.environ.get(PREFIX_ENV, cls.model_fields["prefix"].default),
            ca_file=os.environ.get(ETCD_ENV["ca_file"], ""),
            cert_file=os.environ.get(ETCD_ENV["cert_file"], ""),
            key_file=os.environ.get(ETCD_ENV["key_file"], ""),
            user=os.environ.get(ETCD_ENV["user"], ""),
            password_file=os.environ.get(ETCD_ENV["password_file"], ""),
        )

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[tuple[EtcdKV, Keys]]:
        """A connected client and the key layout; ``MetadataUnavailableError`` if unreachable."""
        endpoints = [e.strip() for e in self.endpoints.split(",") if e.strip()]
        kv = await EtcdKV.connect(
            endpoints, timeout=self.connect_timeout_seconds, security=self.security()
        )
        try:
            yield kv, Keys(self.prefix)
        finally:
            await kv.close()


class ObjectStoreResource(ConfigurableResource):  # type: ignore[type-arg]
    """The brokers' object store (segment objects) and the Parquet warehouse in it.

    The warehouse is the same store below ``warehouse_root``. Credentials are never part of the
    resource: the YAML takes them from the environment (``${ENV}``), as the brokers do.
    """

    config_path: str = ""
    """The broker YAML (``DANUBE_INGEST_CONFIG``); empty: the defaults."""
    data_dir: str = ""
    """``broker.data_dir`` over the YAML's (``DANUBE_INGEST_DATA_DIR``); empty: the YAML's."""
    warehouse_root: str = "warehouse/"
    """Prefix of the tables in the store (``layout.DEFAULT_ROOT``)."""

    @classmethod
    def from_env(cls) -> "ObjectStoreResource":
        """Configured from ``DANUBE_INGEST_CONFIG`` and ``DANUBE_INGEST_DATA_DIR``."""
        return cls(
            config_path=os.environ.get(CONFIG_ENV, ""),
            data_dir=os.environ.get(DATA_DIR_ENV, ""),
        )

    def broker_config(self) -> BrokerConfig:
        """The configuration the store is made from; ``ConfigError`` naming the file and key."""
        overrides = {"broker.data_dir": self.data_dir} if self.data_dir else None
        return load_config(self.config_path or None, overrides)

    def child_env(self) -> dict[str, str]:
        """The environment that gives a child process (the Spark job) the same store."""
        env = {CONFIG_ENV: self.config_path} if self.config_path else {}
        if self.data_dir:
            env[DATA_DIR_ENV] = self.data_dir
        return env

    @asynccontextmanager
    async def open(self) -> AsyncIterator[ObjectStore]:
        """The store, closed on exit."""
        store = ObjectStore.from_config(self.broker_config())
        try:
            yield store
        finally:
            await store.close()


class ConvertJobResource(ConfigurableResource):  # type: ignore[type-arg]
    """How the conversion program is started: ``{python} -m {module} --topic T --start-ms N ...``
    (``danube_ingest.analytics.job``, a plain PySpark program; on a cluster, point ``python``
    and ``extra_args`` at a ``spark-submit`` wrapper)."""

    python: str = sys.executable
    """The interpreter; it also runs Spark's Python workers (``PYSPARK_PYTHON``)."""
    module: str = "danube_ingest.analytics.job"
    extra_args: list[str] = []
    """Appended to the command (``--width-s 60`` ...)."""

    def command(self, topic: str, starts_ms: list[int]) -> list[str]:
        """The command converting ``topic``'s partitions starting at ``starts_ms``."""
        starts = [arg for start in starts_ms for arg in ("--start-ms", str(start))]
        return [self.python, "-m", self.module, "--topic", topic, *starts, *self.extra_args]

    def child_env(self) -> dict[str, str]:
        """What the program needs besides the etcd and object store variables."""
        return {"PYSPARK_PYTHON": self.python, "PYSPARK_DRIVER_PYTHON": self.python}
