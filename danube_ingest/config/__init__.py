"""Broker configuration: typed models loaded from one YAML file.

Every key is optional (each has a documented default) and unknown keys are errors.
``config/danube_broker.yml`` is the annotated example, with every key at its default::

    broker:    BrokerSection   identity, listen address, data directory
    storage:   StorageConfig   mode, wal (+ retention), cache, uploader, cloud
    limits:    LimitsConfig    per-message and per-topic limits the broker enforces
    dispatch:  DispatchConfig  acks, redelivery, poison messages
    etcd:      EtcdConfig      metadata store
    metrics:   MetricsConfig   metrics, health and readiness HTTP port
    auth:      AuthConfig      authentication (JWT, API keys) and permissions (``auth`` module)

Modules: ``values`` (value syntax and field types), ``models`` (the sections), ``loader``
(YAML, interpolation, overrides, error messages).

Value syntax:

- String values may reference environment variables: ``${NAME}`` (an error if NAME is unset)
  or ``${NAME:-default}`` (the default when NAME is unset or empty). ``$${`` is a literal ``${``.
  Keys are never interpolated, and substituted text is not interpolated again.
- Sizes (keys ending in ``_bytes``) take a byte count or a number with a unit: ``8MiB``,
  ``64KiB``, ``1.5GiB`` (powers of 1024) or ``500MB`` (powers of 1000).
- Durations (keys ending in ``_ms``, ``_seconds``, ``_minutes``) take a number in the unit the key
  names, or a number with a unit: ``500ms``, ``10s``, ``5m`` (or ``5min``), ``48h``, ``7d``.
- An empty string (``${VAR:-}`` with VAR unset) means "unset" for keys whose default is null.
- Relative paths are relative to the working directory; ``~`` is expanded.

Invalid input raises :class:`~danube_ingest.errors.ConfigError` naming the dotted key, e.g.
``storage.wal.fsync: must be 'always' or 'never' (got 'sometimes')``.
"""

from danube_ingest.config.auth import AuthConfig
from danube_ingest.config.loader import config_from_env, load_config, parse_config
from danube_ingest.config.models import (
    BrokerConfig,
    BrokerSection,
    CacheConfig,
    CloudConfig,
    DispatchConfig,
    EtcdConfig,
    LimitsConfig,
    RetentionConfig,
    StorageConfig,
    UploaderConfig,
    WalConfig,
)
from danube_ingest.config.values import parse_duration, parse_size

__all__ = [
    "AuthConfig",
    "BrokerConfig",
    "BrokerSection",
    "CacheConfig",
    "CloudConfig",
    "DispatchConfig",
    "EtcdConfig",
    "LimitsConfig",
    "RetentionConfig",
    "StorageConfig",
    "UploaderConfig",
    "WalConfig",
    "config_from_env",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_size",
]
