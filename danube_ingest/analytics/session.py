"""SparkSessions as the project builds them: workers run this interpreter, local drivers stay on
loopback.

::

    from danube_ingest.analytics import spark_session

    spark = spark_session("my-notebook")  # master: as launched (spark-submit), else local[*]

Guarantees of :func:`spark_session` (used by ``tables convert --engine spark``, the Spark job and
the docs' examples):

* ``PYSPARK_PYTHON`` is set to this interpreter when unset, so Spark's Python workers (tasks,
  the ``danube`` data source) import ``danube_ingest``, pyarrow and opendal. Spark reads it when
  the SparkContext starts, so it applies only to a session this call creates.
* In local mode (``spark.master`` ``local``, ``local[N]``...) the driver binds to and advertises
  ``127.0.0.1`` (``spark.driver.bindAddress``, ``spark.driver.host``) instead of the address the
  machine's host name resolves to, so a local job opens no port on an external interface. Left
  alone when either setting is given (``config``, ``spark-defaults.conf``, ``spark-submit
  --conf``, ``PYSPARK_SUBMIT_ARGS``) or ``SPARK_LOCAL_IP`` is set, and on any other master.
* An active SparkContext is reused as it is (Spark's ``getOrCreate``): nothing above changes it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from danube_ingest.config.models import BrokerConfig

__all__ = ["LOOPBACK", "catalog_session", "driver_settings", "spark_session"]

LOOPBACK = "127.0.0.1"
"""Where a local-mode driver binds and what it advertises to its executors."""
DRIVER_ADDRESS_KEYS = ("spark.driver.bindAddress", "spark.driver.host")
"""Spark settings that choose the driver's address; one given by the user keeps both as set."""


def driver_settings(given: Mapping[str, str]) -> dict[str, str]:
    """The settings :func:`spark_session` adds to ``given`` (settings passed in code): both
    driver address keys set to loopback in local mode, nothing otherwise (see the module
    docstring). Starts Spark's JVM gateway, if not started yet, to read the settings it was
    launched with."""
    from pyspark import SparkConf, SparkContext

    if os.environ.get("SPARK_LOCAL_IP"):
        return {}
    # Launched with ``given`` (as getOrCreate would launch it, so settings read only when the
    # JVM starts, like spark.driver.memory, still apply); its system properties carry
    # spark-defaults.conf and spark-submit's --conf.
    SparkContext._ensure_initialized(conf=SparkConf(loadDefaults=False).setAll(list(given.items())))
    launched = SparkConf()

    def setting(key: str) -> str | None:
        if key in given:
            return given[key]
        return launched.get(key) if launched.contains(key) else None

    master = setting("spark.master") or "local[*]"
    if master != "local" and not master.startswith("local["):
        return {}
    if any(setting(key) is not None for key in DRIVER_ADDRESS_KEYS):
        return {}
    return dict.fromkeys(DRIVER_ADDRESS_KEYS, LOOPBACK)


def spark_session(
    app_name: str = "danube-ingest",
    *,
    master: str | None = None,
    config: Mapping[str, str] | None = None,
) -> SparkSession:
    """The active SparkSession, else a new one named ``app_name`` with ``master`` (default: as
    launched, else ``local[*]``) and ``config``, built as the module docstring guarantees."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    given = dict(config or {})
    if master is not None:
        given["spark.master"] = master
    if SparkContext._active_spark_context is None:
        given = {**given, **driver_settings(given)}
    builder = SparkSession.builder.appName(app_name)
    for key, value in given.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def catalog_session(
    app_name: str = "danube-ingest",
    *,
    master: str | None = None,
    config: Mapping[str, str] | None = None,
    broker_config: BrokerConfig | None = None,
) -> SparkSession:
    """A SparkSession (as :func:`spark_session` builds it) in which the topics' Iceberg tables
    are reachable by name: ``spark.sql("SELECT * FROM danube.default.orders")``.

    The catalog is the brokers' ``iceberg`` section (``broker_config``; default: the file
    ``DANUBE_INGEST_CONFIG`` names, with ``DANUBE_INGEST_DATA_DIR``, else the defaults): its
    settings and the Iceberg jars ``make setup`` fetched are added to ``config`` (``config``
    wins on a clash). A SparkContext already running keeps the jars it started with.
    ``ConfigError`` when ``iceberg.catalog`` is ``off`` or the jars are missing.
    """
    from danube_ingest.analytics.iceberg import IcebergTarget
    from danube_ingest.config import config_from_env
    from danube_ingest.errors import ConfigError

    target = IcebergTarget.from_config(broker_config or config_from_env())
    if target is None:
        raise ConfigError(
            "no Iceberg catalog: iceberg.catalog is off (or the object store is memory), so "
            "tables are plain Parquet; read them with danube_ingest.analytics.read_topic"
        )
    return spark_session(
        app_name, master=master, config={**target.spark_config(), **(config or {})}
    )
