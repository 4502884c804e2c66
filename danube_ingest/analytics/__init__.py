"""Analytics: topics as committed, definite Parquet tables (see docs/analytics.md).

``analytics`` may import ``objects``, ``metadata``, ``schema`` and ``wal.framing``; never
``broker``, Dagster or (outside ``spark_source``) pyspark.
"""
