"""Fixtures of the analytics tests: the real daemon's output for three topics, made once."""

from __future__ import annotations

import pytest

from tests.analytics.daemon_support import Produced, produce_topics


@pytest.fixture(scope="session")
def produced(etcd_server: str, tmp_path_factory: pytest.TempPathFactory) -> Produced:
    """Three topics produced through danube-client into the real daemon (``daemon_support``)."""
    return produce_topics(etcd_server, tmp_path_factory.mktemp("daemon"))
