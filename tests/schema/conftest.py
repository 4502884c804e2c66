"""Fixtures for the schema tests: a registry on an in-memory store with a fixed clock."""

from __future__ import annotations

import pytest

from danube_ingest.schema import MemorySchemaStore, SchemaRegistry

NOW = 1_700_000_000


@pytest.fixture
def store() -> MemorySchemaStore:
    return MemorySchemaStore()


@pytest.fixture
def registry(store: MemorySchemaStore) -> SchemaRegistry:
    return SchemaRegistry(store, clock=lambda: NOW)
