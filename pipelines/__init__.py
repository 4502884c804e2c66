"""The Dagster code location: jobs, schedules and resources over :mod:`assets`.

Load it with ``dagster dev -w workspace.yaml`` (``danube-ingest dev`` does); the definitions are
in :mod:`pipelines.definitions`.
"""
