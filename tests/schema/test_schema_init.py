"""The package's public API is exactly ``__all__``."""

from __future__ import annotations

import danube_ingest.schema as schema


def test_all_names_resolve_and_are_sorted() -> None:
    assert schema.__all__ == sorted(schema.__all__)
    for name in schema.__all__:
        assert getattr(schema, name).__module__.startswith("danube_ingest.schema.")


def test_every_public_class_is_exported() -> None:
    public = {
        name
        for name, value in vars(schema).items()
        if isinstance(value, type) and not name.startswith("_")
    }
    assert public == set(schema.__all__)
