"""The danube-ingest image, built once per test run (``tests.containers.support.build``)."""

from __future__ import annotations

import pytest

from tests.containers.support import build


@pytest.fixture(scope="session")
def image() -> str:
    return build()
