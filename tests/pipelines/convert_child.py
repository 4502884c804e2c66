"""A stand-in for ``python -m danube_ingest.analytics.job`` with the same command line,
environment and Pipes reports, converting with the library's run protocol (tests only, until
the Spark program is on this branch): ``--topic T --start-ms N ...``.

It converts exactly the given partitions of tests.pipelines.parquet_support's topic and
reports one Pipes materialization with the rows and offsets it committed.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from dagster_pipes import open_dagster_pipes

from danube_ingest.config.loader import load_config
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from tests.pipelines.parquet_support import convert


async def main(topic: str, starts: list[int]) -> list[tuple[int, int, int, int, list[str]]]:
    data_dir = os.environ.get("DANUBE_INGEST_DATA_DIR")
    config = load_config(
        os.environ.get("DANUBE_INGEST_CONFIG") or None,
        {"broker.data_dir": data_dir} if data_dir else None,
    )
    kv = await EtcdKV.connect(os.environ["DANUBE_INGEST_ETCD_ENDPOINTS"].split(","))
    store = ObjectStore.from_config(config)
    try:
        return await convert(kv, Keys(os.environ["DANUBE_INGEST_ETCD_PREFIX"]), store, starts)
    finally:
        await store.close()
        await kv.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", required=True)
    parser.add_argument("--start-ms", type=int, action="append", default=[])
    args = parser.parse_args()
    with open_dagster_pipes() as pipes:
        done = asyncio.run(main(args.topic, args.start_ms))
        pipes.log.info(f"converted topic={args.topic} partitions={len(done)}")
        pipes.report_asset_materialization(
            metadata={
                "rows": sum(d[1] for d in done),
                "partitions": len(done),
            }
        )
