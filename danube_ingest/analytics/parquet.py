"""Writing one partition's rows as Parquet through the ``ObjectStore``.

Guarantees of ``write_partition``:

* **One file per partition** unless it exceeds ``max_rows`` rows or ``max_bytes`` of Arrow data
  (4 Mi rows, 512 MiB by default); only then is it cut into several ``part-`` files. One file is
  one PUT, and a PUT is atomic, so a plain ``spark.read.parquet`` of a rendition sees a
  partition either not at all or whole; with several files it could list some before the
  others are published.
* **Deterministic bytes**: the same rows in any batch order give byte-for-byte the same files
  and names. Rows are sorted by offset; compression (zstd level 3), row-group size (128 Ki
  rows), page settings and the Parquet writer version are fixed; nothing time-dependent is
  written (the only key-value metadata is the Arrow schema; ``created_by`` names the pyarrow
  version, so a pyarrow upgrade is a converter version change).
* Files are named from the offsets they hold (``layout.file_name``), so a rerun writes the
  same keys. Each file is built in memory (at most ``max_bytes`` of Arrow data, compressed) and
  written with one PUT.
* Rows whose schema differs from ``schema`` (names, types, order) or that repeat an offset are
  refused with ``PartitionDataError`` before anything is written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import crc32c
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from danube_ingest.analytics.columns import DEAD_LETTER_SCHEMA, DECODE_ERROR
from danube_ingest.analytics.errors import PartitionDataError
from danube_ingest.analytics.layout import file_name
from danube_ingest.objects.store import ObjectStore

__all__ = ["MAX_FILE_BYTES", "MAX_FILE_ROWS", "FileInfo", "encode_parquet", "write_partition"]

#: Rows per file before a partition is split: a minute or an hour of a busy topic fits; beyond,
#: one in-memory file would cost too much memory for one task.
MAX_FILE_ROWS = 4 << 20
#: Arrow bytes per file before a partition is split (the file is built in memory).
MAX_FILE_BYTES = 512 << 20
#: Rows per row group: big enough for good compression, small enough that a reader filtering
#: on offset skips most of a large file.
ROW_GROUP_ROWS = 128 << 10
#: zstd at its default level: fast to write, about as small as snappy's double.
COMPRESSION = "zstd"
COMPRESSION_LEVEL = 3


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A Parquet file written for a partition."""

    path: str
    """Its key in the object store."""
    size: int
    rows: int
    first_offset: int
    last_offset: int
    crc32c: int
    """CRC32C of the file's bytes."""
    dead_letters: bool = False
    """Holds rows that did not decode (``write_partition``'s ``dead_letters``)."""


def encode_parquet(table: pa.Table) -> bytes:
    """The Parquet bytes of ``table`` with the fixed, deterministic settings above."""
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        row_group_size=ROW_GROUP_ROWS,
        compression=COMPRESSION,
        compression_level=COMPRESSION_LEVEL,
        version="2.6",
        data_page_version="1.0",
        use_dictionary=True,
        write_statistics=True,
        store_schema=True,
    )
    return bytes(sink.getvalue().to_pybytes())


def _sorted_rows(batches: Iterable[pa.RecordBatch], schema: pa.Schema, where: str) -> pa.Table:
    collected = []
    for index, batch in enumerate(batches):
        if not batch.schema.equals(schema, check_metadata=False):
            raise PartitionDataError(
                f"batch {index} for {where} does not match the table schema: "
                f"expected {schema}, got {batch.schema}; convert it to the schema first"
            )
        collected.append(batch)
    table = pa.Table.from_batches(collected, schema=schema)
    if "offset" not in schema.names or schema.field("offset").type != pa.int64():
        raise PartitionDataError(f"the schema for {where} has no int64 'offset' column")
    table = table.sort_by("offset")
    if table.num_rows:
        offsets = table.column("offset")
        if offsets.null_count:
            raise PartitionDataError(f"rows for {where} have null offsets")
        if table.num_rows > 1:
            repeated = pc.equal(offsets.slice(1), offsets.slice(0, table.num_rows - 1))
            if pc.any(repeated).as_py():
                index = pc.index(repeated, True).as_py()
                duplicate = offsets[index].as_py()
                raise PartitionDataError(
                    f"rows for {where} repeat offset {duplicate}; each offset must appear once"
                )
    return table.combine_chunks()


def _cuts(table: pa.Table, max_rows: int, max_bytes: int) -> list[pa.Table]:
    """Consecutive slices of at most ``max_rows`` rows and (roughly) ``max_bytes``."""
    if table.num_rows == 0:
        return []
    per_row = max(1, table.nbytes // table.num_rows)
    step = max(1, min(max_rows, max_bytes // per_row))
    return [table.slice(start, step) for start in range(0, table.num_rows, step)]


async def write_partition(
    store: ObjectStore,
    directory: str,
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    *,
    max_rows: int = MAX_FILE_ROWS,
    max_bytes: int = MAX_FILE_BYTES,
    dead_letters: str | None = None,
) -> list[FileInfo]:
    """Write the rows of one partition as Parquet files under ``directory`` (ending with ``/``).

    Returns the files in offset order: none for no rows, one unless the bounds are exceeded
    (see the module docstring). Each file is written with one ``put``; an existing object under
    the same key is replaced (its name says it holds the same offsets).

    ``dead_letters``: a directory for the rows whose ``decode_error`` is set (with the fixed
    columns and ``decode_error`` only: ``DEAD_LETTER_SCHEMA``), written the same way after the
    others (``FileInfo.dead_letters``); the table's files then hold only rows that decoded.
    """
    if not directory.endswith("/"):
        raise ValueError(f"directory must end with '/' (got {directory!r})")
    if max_rows < 1 or max_bytes < 1:
        raise ValueError(f"max_rows and max_bytes must be >= 1 (got {max_rows}, {max_bytes})")
    table = _sorted_rows(batches, schema, directory)
    if dead_letters is None:
        return await _write(store, directory, table, max_rows, max_bytes, False)
    if not dead_letters.endswith("/"):
        raise ValueError(f"dead_letters must end with '/' (got {dead_letters!r})")
    failed = pc.is_valid(table.column(DECODE_ERROR.name))
    good = table.filter(pc.invert(failed))
    bad = table.filter(failed).select(DEAD_LETTER_SCHEMA.names).cast(DEAD_LETTER_SCHEMA)
    files = await _write(store, directory, good, max_rows, max_bytes, False)
    return files + await _write(store, dead_letters, bad, max_rows, max_bytes, True)


async def _write(
    store: ObjectStore,
    directory: str,
    table: pa.Table,
    max_rows: int,
    max_bytes: int,
    dead_letters: bool,
) -> list[FileInfo]:
    files: list[FileInfo] = []
    for piece in _cuts(table, max_rows, max_bytes):
        offsets = piece.column("offset")
        first, last = offsets[0].as_py(), offsets[-1].as_py()
        data = await asyncio.to_thread(encode_parquet, piece)
        path = f"{directory}{file_name(first, last)}"
        await store.put(path, data)
        files.append(
            FileInfo(
                path, len(data), piece.num_rows, first, last, crc32c.crc32c(data), dead_letters
            )
        )
    return files
