"""The storage the registry needs, as a protocol, and an in-memory implementation.

The registry keeps every record under keys it builds itself (see ``registry.py``); a store only
has to provide single-key reads and writes, a prefix scan, and one atomic primitive,
compare-and-set. ``tests/schema/test_schema_store.py`` holds the contract every implementation
must pass.
"""

from __future__ import annotations

from typing import Protocol


class SchemaStore(Protocol):
    """Bytes under string keys. Every method is atomic on its own; none spans several keys."""

    async def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None."""
        ...

    async def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""
        ...

    async def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...

    async def list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` whose key starts with ``prefix``, sorted by key."""
        ...

    async def create_if_absent(self, key: str, value: bytes) -> bool:
        """Store ``value`` only if ``key`` does not exist; True if it was stored."""
        ...

    async def compare_and_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Store ``value`` only if the current value equals ``expected`` (None: the key is
        absent); True if it was stored."""
        ...


class MemorySchemaStore:
    """A :class:`SchemaStore` in a dict, for tests and single-process use.

    Methods never yield to the event loop, so each is atomic with respect to other tasks.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    async def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    async def put(self, key: str, value: bytes) -> None:
        self._data[key] = bytes(value)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        return sorted((k, v) for k, v in self._data.items() if k.startswith(prefix))

    async def create_if_absent(self, key: str, value: bytes) -> bool:
        if key in self._data:
            return False
        self._data[key] = bytes(value)
        return True

    async def compare_and_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        if self._data.get(key) != expected:
            return False
        self._data[key] = bytes(value)
        return True
