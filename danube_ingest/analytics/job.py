"""The conversion as a plain PySpark program: ``python -m danube_ingest.analytics.job`` or
``spark-submit danube_ingest/analytics/job.py`` (the same program runs on a cluster).

Usage: ``job --topic T [--start-ms N ...] [--width-s 3600] [--engine spark|local]
[--root warehouse/]``. Without ``--start-ms`` every complete, uncommitted partition is
converted (``convert.convert``); with them, exactly those (an incomplete one fails the run).

Where things are, from the environment (as the daemon's CLI reads them):

* ``DANUBE_INGEST_CONFIG``: the daemon's YAML config (``config.load_config``); its
  ``storage.cloud`` section is the objects store, and the warehouse lives in the same store
  under ``--root``. Unset: the defaults (fs objects under ``./data/objects``).
* ``DANUBE_INGEST_DATA_DIR``: overrides ``broker.data_dir`` (where fs objects live by default).
* ``DANUBE_INGEST_ETCD_ENDPOINTS`` (comma-separated) and ``DANUBE_INGEST_ETCD_PREFIX``: override
  the config's ``etcd.endpoints`` and ``etcd.prefix``.

Credentials are never passed to Spark tasks: executors read them from their environment.
``PYSPARK_PYTHON`` is set to this interpreter when unset, so workers import ``danube_ingest``;
in local mode the driver stays on 127.0.0.1 unless configured (``analytics.session``).

Output: launched by Dagster Pipes (its environment variables present), the job logs one line
per partition, reports each partition as a custom message (``result_json``'s partition
entry) and, in an asset step, one asset materialization with the run's totals and partitions;
without Pipes it prints one JSON line (``result_json``). Exit code 0: done; 1: the conversion
failed (the error is on stderr and, under Pipes, a custom message ``{"error", "cause",
"retriable"}``; partitions before the failing one stay committed); 2: bad usage or
configuration.

With ``--start-ms``, what needs only etcd and the store's listing (a partition not complete,
a manifest object missing: ``preflight.preflight``) is checked before a SparkSession starts,
and no session starts when every requested partition is already committed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from danube_ingest.analytics.convert import (
    ConvertResult,
    StoreSpec,
    convert,
    failure_cause,
    result_json,
)
from danube_ingest.analytics.iceberg import IcebergTarget
from danube_ingest.analytics.layout import DEFAULT_ROOT, DEFAULT_WIDTH_S
from danube_ingest.analytics.preflight import preflight
from danube_ingest.analytics.session import spark_session
from danube_ingest.config import config_from_env
from danube_ingest.config.models import BrokerConfig
from danube_ingest.errors import ConfigError, DanubeIngestError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.keys import Keys
from danube_ingest.objects.store import ObjectStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["main"]

log = logging.getLogger("danube_ingest.analytics.job")

ENDPOINTS_ENV = "DANUBE_INGEST_ETCD_ENDPOINTS"
PREFIX_ENV = "DANUBE_INGEST_ETCD_PREFIX"
PIPES_ENV = "DAGSTER_PIPES_CONTEXT"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="danube_ingest.analytics.job",
        description="Convert a topic's complete partitions into committed Parquet (Spark).",
    )
    parser.add_argument("--topic", required=True, help="the topic, /namespace/topic")
    parser.add_argument(
        "--start-ms",
        type=int,
        action="append",
        help="convert exactly this partition (its start, ms since the epoch); repeatable",
    )
    parser.add_argument(
        "--width-s",
        type=int,
        default=DEFAULT_WIDTH_S,
        help="partition width of a table created by this run (default 3600)",
    )
    parser.add_argument(
        "--engine",
        choices=("spark", "local"),
        default="spark",
        help="spark: one Spark task per partition (default); local: this process only",
    )
    parser.add_argument("--root", default=DEFAULT_ROOT, help="warehouse root in the store")
    return parser


def _session() -> SparkSession:
    return spark_session("danube-ingest-convert")


async def _run(args: argparse.Namespace, config: BrokerConfig) -> ConvertResult:
    endpoints_text = os.environ.get(ENDPOINTS_ENV)
    endpoints = (
        [e.strip() for e in endpoints_text.split(",") if e.strip()]
        if endpoints_text
        else list(config.etcd.endpoints)
    )
    keys = Keys(os.environ.get(PREFIX_ENV) or config.etcd.prefix)
    spec = StoreSpec.from_config(config) if args.engine == "spark" else None
    objects = ObjectStore.from_config(config)

    async def connect() -> EtcdKV:
        return await EtcdKV.connect(
            endpoints,
            timeout=config.etcd.connect_timeout_seconds,
            security=EtcdSecurity.from_env_or_config(config.etcd),
        )

    try:
        need_spark = args.engine == "spark"
        if args.start_ms:
            # What needs only etcd and the store's listing is refused before Spark starts.
            kv = await connect()
            try:
                checked = await preflight(
                    kv, keys, args.topic, args.start_ms, width_s=args.width_s, objects=objects
                )
            finally:
                await kv.close()
            need_spark = need_spark and bool(checked.convert) and not checked.outside
        # Spark forks its JVM with no etcd connection open: gRPC skips its fork handlers while
        # another thread is inside a call, and the JVM's launch then failed now and then
        # ("Java gateway process exited before sending its port number").
        spark = _session() if need_spark else None
        kv = await connect()
        try:
            return await convert(
                kv=kv,
                keys=keys,
                objects=objects,
                warehouse=objects,
                topic=args.topic,
                starts_ms=args.start_ms,
                engine=args.engine,
                spark=spark,
                width_s=args.width_s,
                root=args.root,
                objects_spec=spec,
                warehouse_spec=spec,
                iceberg=IcebergTarget.from_config(config),
            )
        finally:
            await kv.close()
    finally:
        await objects.close()


def _report_pipes(result: ConvertResult) -> None:
    """Report ``result`` to the Dagster run that launched this process through Pipes."""
    from dagster_pipes import open_dagster_pipes

    summary = result_json(result)
    with open_dagster_pipes() as pipes:
        for part in summary["partitions"]:
            pipes.log.info(
                f"partition topic={result.topic} start_ms={part['start_ms']} "
                f"outcome={part['outcome']} rows={part['rows']} first_offset="
                f"{part['first_offset']} last_offset={part['last_offset']} "
                f"files={len(part['files'])}"
            )
            pipes.report_custom_message(part)
        if pipes.is_asset_step:
            committed = [p for p in summary["partitions"] if p["outcome"] == "committed"]
            metadata: dict[str, Any] = {
                "topic": result.topic,
                "rendition": result.rendition,
                "partitions": len(summary["partitions"]),
                "committed": len(committed),
                "rows": sum(p["rows"] for p in committed),
                "first_offset": min(
                    (p["first_offset"] for p in committed if p["rows"]), default=-1
                ),
                "last_offset": max((p["last_offset"] for p in committed), default=-1),
                "files": [f for p in summary["partitions"] for f in p["files"]],
                "upper_ms": result.upper_ms,
                "input_revision": result.input_revision,
            }
            if result.published is not None:
                metadata["iceberg_table"] = result.published.table
                metadata["iceberg_snapshot"] = str(summary["iceberg_snapshot"] or "unchanged")
            pipes.report_asset_materialization(metadata=metadata)


def _report_pipes_error(exc: DanubeIngestError, cause: str) -> None:
    """Launched through Pipes: report why the run failed as a custom message
    ``{"error", "cause", "retriable"}``, so Dagster can show it as the failure's cause."""
    if not os.environ.get(PIPES_ENV):
        return
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        pipes.report_custom_message(
            {"error": str(exc), "cause": cause, "retriable": bool(exc.retriable)}
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; returns the exit code (see the module docstring)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        config = config_from_env()
        result = asyncio.run(_run(args, config))
    except ConfigError as exc:
        print(f"danube_ingest.analytics.job: {exc}", file=sys.stderr)
        _report_pipes_error(exc, "config")
        return 2
    except DanubeIngestError as exc:
        print(f"danube_ingest.analytics.job: {exc}", file=sys.stderr)
        _report_pipes_error(exc, failure_cause(exc))
        return 1
    if os.environ.get(PIPES_ENV):
        _report_pipes(result)
    else:
        print(json.dumps(result_json(result), separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
