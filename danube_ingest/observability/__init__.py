"""Observability: Prometheus metrics, the health endpoints and the gRPC call metrics.

``metrics`` (imported by the storage layers: it depends on prometheus-client only),
``collector`` (a broker's figures read when scraped), ``rpc`` (the grpc.aio interceptor) and
``http`` (the ``/metrics``, ``/healthz`` and ``/readyz`` server). See docs/metrics.md.
"""
