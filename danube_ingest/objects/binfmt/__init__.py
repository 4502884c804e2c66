"""The ``.bin`` object format: runs of WAL frames of one or more topics, and a footer indexing
them.

:mod:`danube_ingest.objects.binfmt.layout` states the byte layout and holds the constants, the
footer's data classes and the footer and trailer codec;
:mod:`danube_ingest.objects.binfmt.writer` builds objects (:class:`BinWriter`);
:mod:`danube_ingest.objects.binfmt.decoder` reads them.
"""

from danube_ingest.objects.binfmt.decoder import (
    FOOTER_GUESS_BYTES,
    GetRange,
    decode_frame_bytes,
    decode_range,
    frame_wal_bytes,
    parse_object,
    read_footer_from,
    stored_frame_bytes,
)
from danube_ingest.objects.binfmt.layout import (
    CODECS,
    FORMAT_VERSION,
    FRAME_PREFIX_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_RAW_LEN,
    MIN_OBJECT_SIZE,
    TRAILER_SIZE,
    Footer,
    FrameRef,
    TopicSpan,
    read_footer,
)
from danube_ingest.objects.binfmt.writer import MAX_FRAME_TARGET, BinWriter

__all__ = [
    "CODECS",
    "FOOTER_GUESS_BYTES",
    "FORMAT_VERSION",
    "FRAME_PREFIX_SIZE",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FRAME_TARGET",
    "MAX_RAW_LEN",
    "MIN_OBJECT_SIZE",
    "TRAILER_SIZE",
    "BinWriter",
    "Footer",
    "FrameRef",
    "GetRange",
    "TopicSpan",
    "decode_frame_bytes",
    "decode_range",
    "frame_wal_bytes",
    "parse_object",
    "read_footer",
    "read_footer_from",
    "stored_frame_bytes",
]
