"""The danube-ingest image, built once per test run (``tests.containers.support``)."""

from __future__ import annotations

import pytest

from tests.containers.support import background_builds


@pytest.fixture(scope="session")
def image() -> str:
    return background_builds()[0]


@pytest.fixture(scope="session")
def rebuilt_image() -> str:
    """The same tree built again from the Debian base, for the reproducibility check."""
    return background_builds()[1]
