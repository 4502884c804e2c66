"""Analytics: topics as committed, definite Parquet tables (see docs/analytics.md).

``analytics`` may import ``objects``, ``metadata``, ``schema`` and ``wal.framing``; never
``broker``, Dagster or (outside ``spark_source``) pyspark.

:mod:`~danube_ingest.analytics.columns` fixes the columns; :mod:`~danube_ingest.analytics.decode`
turns entries into record batches (decoding Avro and JSON Schema payloads);
:mod:`~danube_ingest.analytics.source` plans and reads a topic's objects without Spark;
``danube_ingest.analytics.spark_source`` (imported on its own: it needs pyspark) is the Spark
data source ``"danube"``.
"""

from danube_ingest.analytics.columns import DECODE_ERROR, FIXED_SCHEMA, table_schema
from danube_ingest.analytics.decode import SchemaDecoder, entries_to_batch, load_decoder
from danube_ingest.analytics.source import (
    MAX_ROWS,
    ReadPart,
    aread_part,
    plan_reads,
    read_part,
)

__all__ = [
    "DECODE_ERROR",
    "FIXED_SCHEMA",
    "MAX_ROWS",
    "ReadPart",
    "SchemaDecoder",
    "aread_part",
    "entries_to_batch",
    "load_decoder",
    "plan_reads",
    "read_part",
    "table_schema",
]
