"""Writing a partition's Parquet files (danube_ingest.analytics.parquet) on memory, fs, s3."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from danube_ingest.analytics.errors import PartitionDataError
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.objects.store import ObjectStore

from .tables_support import SCHEMA, rows, warehouse

__all__ = ["warehouse"]

DIR = "warehouse/r1/namespace=default/topic=orders/date=2026-11-24/hour=10/"


async def test_one_sorted_file_named_by_its_offsets(warehouse: ObjectStore) -> None:
    files = await write_partition(warehouse, DIR, [rows(range(50, 100)), rows(range(50))], SCHEMA)
    assert len(files) == 1
    info = files[0]
    assert info.path == DIR + "part-00000000000000000000-00000000000000000099.parquet"
    assert (info.rows, info.first_offset, info.last_offset) == (100, 0, 99)
    data = await warehouse.get(info.path)
    assert len(data) == info.size
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.equals(SCHEMA)
    assert table.equals(pa.Table.from_batches([rows(range(100))]))
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    assert metadata.row_group(0).column(0).compression == "ZSTD"
    assert set(metadata.metadata or {}) == {b"ARROW:schema"}


async def test_identical_input_gives_byte_identical_files(warehouse: ObjectStore) -> None:
    first = await write_partition(warehouse, DIR, [rows(range(300))], SCHEMA)
    one = await warehouse.get(first[0].path)
    shuffled = [rows(range(200, 300)), rows(range(0, 100)), rows(range(100, 200))]
    second = await write_partition(warehouse, "again/" + DIR, shuffled, SCHEMA)
    two = await warehouse.get(second[0].path)
    assert one == two
    assert (first[0].size, first[0].crc32c) == (second[0].size, second[0].crc32c)


async def test_split_into_part_files_only_past_the_bound() -> None:
    store = ObjectStore.memory()
    files = await write_partition(store, DIR, [rows(range(25))], SCHEMA, max_rows=10)
    assert [(f.first_offset, f.last_offset, f.rows) for f in files] == [
        (0, 9, 10),
        (10, 19, 10),
        (20, 24, 5),
    ]
    assert await store.list("") == sorted(f.path for f in files)
    assert len(await write_partition(store, "b/", [rows(range(25))], SCHEMA, max_rows=25)) == 1


async def test_no_rows_no_file() -> None:
    store = ObjectStore.memory()
    assert await write_partition(store, DIR, [], SCHEMA) == []
    assert await write_partition(store, DIR, [rows([])], SCHEMA) == []
    assert await store.list("") == []


async def test_bad_rows_are_refused_and_nothing_is_written() -> None:
    store = ObjectStore.memory()
    with pytest.raises(PartitionDataError, match="repeat offset 7"):
        await write_partition(store, DIR, [rows(range(10)), rows([7])], SCHEMA)
    other = rows(range(3)).drop_columns(["payload"])
    with pytest.raises(PartitionDataError, match=r"batch 1 .* does not match the table schema"):
        await write_partition(store, DIR, [rows(range(3)), other], SCHEMA)
    assert await store.list("") == []
