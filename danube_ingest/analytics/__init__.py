"""Analytics: topics as committed, definite Parquet tables (see docs/analytics.md).

``analytics`` may import ``objects``, ``metadata``, ``schema`` and ``wal.framing``; never
``broker``, Dagster or (outside ``spark_source``) pyspark.

:mod:`~danube_ingest.analytics.columns` fixes the columns; :mod:`~danube_ingest.analytics.decode`
turns entries into record batches (decoding Avro and JSON Schema payloads);
:mod:`~danube_ingest.analytics.source` plans and reads a topic's objects without Spark;
:func:`convert` runs a conversion into committed Parquet (its Spark engine imports pyspark only
when used) and :func:`read_topic` gives analysts the committed partitions as a DataFrame;
:func:`spark_session` builds a SparkSession as the project does (workers on this interpreter,
a local driver on loopback; pyspark imported when called);
``danube_ingest.analytics.spark_source`` (imported on its own: it needs pyspark) is the Spark
data source ``"danube"``.
"""

from danube_ingest.analytics.columns import DECODE_ERROR, FIXED_SCHEMA, table_schema
from danube_ingest.analytics.convert import (
    ConvertError,
    ConvertResult,
    PartitionResult,
    StoreSpec,
    convert,
    pending_partitions,
)
from danube_ingest.analytics.decode import SchemaDecoder, entries_to_batch, load_decoder
from danube_ingest.analytics.read import TopicRead, open_topic, read_topic
from danube_ingest.analytics.session import catalog_session, spark_session
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
    "ConvertError",
    "ConvertResult",
    "PartitionResult",
    "ReadPart",
    "SchemaDecoder",
    "StoreSpec",
    "TopicRead",
    "aread_part",
    "catalog_session",
    "convert",
    "entries_to_batch",
    "load_decoder",
    "open_topic",
    "pending_partitions",
    "plan_reads",
    "read_part",
    "read_topic",
    "spark_session",
    "table_schema",
]
