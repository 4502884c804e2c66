"""The schema registry's storage on the metadata KV (etcd in production).

Every key lives under ``{prefix}/schemas/``; compare-and-set is one etcd transaction
(comparing the value, or absence through ``create_revision == 0``).
"""

from __future__ import annotations

from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Put


class KVSchemaStore:
    """A :class:`~danube_ingest.schema.store.SchemaStore` over a :class:`KV`."""

    def __init__(self, kv: KV, keys: Keys) -> None:
        self._kv = kv
        self._root = keys.schemas_prefix()

    async def get(self, key: str) -> bytes | None:
        found = await self._kv.get(self._root + key)
        return None if found is None else found.value

    async def put(self, key: str, value: bytes) -> None:
        await self._kv.put(self._root + key, bytes(value))

    async def delete(self, key: str) -> None:
        await self._kv.delete(self._root + key)

    async def list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        root = self._root
        found = await self._kv.get_prefix(root + prefix)
        return sorted((kv.key[len(root) :], kv.value) for kv in found)

    async def create_if_absent(self, key: str, value: bytes) -> bool:
        full = self._root + key
        result = await self._kv.txn([Compare.absent(full)], [Put(full, bytes(value))])
        return result.succeeded

    async def compare_and_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        full = self._root + key
        compare = Compare.absent(full) if expected is None else Compare.value_is(full, expected)
        result = await self._kv.txn([compare], [Put(full, bytes(value))])
        return result.succeeded


__all__ = ["KVSchemaStore"]
