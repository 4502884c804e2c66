"""danube_ingest.client: an asyncio client for the batch path (``danube_ingest.v1``).

``Producer`` publishes batches with idempotent retries; ``Consumer`` receives batches and acks
ranges. See docs/design/batch_protocol.md for the wire format and guarantees.
"""

from danube_ingest.client._auth import TokenProvider, call_metadata
from danube_ingest.client._consumer import Batch, Consumer, SubType, decode_batch
from danube_ingest.client._errors import (
    ClientError,
    ConsumeError,
    DeliveryTimeoutError,
    PublishError,
    stream_lost,
)
from danube_ingest.client._producer import Compression, Producer, new_producer_id, target
from danube_ingest.client._tls import TlsOptions, open_channel

__all__ = [
    "Batch",
    "ClientError",
    "Compression",
    "ConsumeError",
    "Consumer",
    "DeliveryTimeoutError",
    "Producer",
    "PublishError",
    "SubType",
    "TlsOptions",
    "TokenProvider",
    "call_metadata",
    "decode_batch",
    "new_producer_id",
    "open_channel",
    "stream_lost",
    "target",
]
