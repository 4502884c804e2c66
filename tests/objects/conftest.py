"""Fixtures of the object store tests.

* ``object_store``: the same test on ``memory``, ``fs`` (a tmp dir) and ``s3`` (the session's
  moto server, a fresh root per test in a shared bucket), for the contract suite.
* ``s3_bucket`` (session): that shared bucket.
* ``stack``: a broker's cold path (``support.ColdStack``) on the real etcd over ``object_store``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore, RetryPolicy
from danube_ingest.testing import MotoServer

from .support import ColdStack

#: Retries that give up within milliseconds: no contract test expects a transient error, and a
#: broken one should fail fast instead of sleeping through the default backoff.
FAST_RETRY = RetryPolicy(max_retries=2, base_delay=0.001, max_delay=0.005)


@pytest.fixture(scope="session")
def s3_bucket(s3_server: MotoServer) -> str:
    return s3_server.create_bucket("danube-objects-test")


@pytest.fixture(params=["memory", "fs", pytest.param("s3", marks=pytest.mark.s3)])
async def object_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[ObjectStore]:
    store: ObjectStore
    if request.param == "memory":
        store = ObjectStore.memory(retry=FAST_RETRY)
    elif request.param == "fs":
        store = ObjectStore("fs", options={"root": str(tmp_path / "objects")}, retry=FAST_RETRY)
    else:
        server: MotoServer = request.getfixturevalue("s3_server")
        bucket: str = request.getfixturevalue("s3_bucket")
        root = f"/test-{uuid.uuid4().hex[:12]}"
        store = ObjectStore("s3", options=server.options(bucket, root), retry=FAST_RETRY)
    yield store
    await store.close()


@pytest.fixture
async def stack(
    etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore, tmp_path: Path
) -> AsyncIterator[ColdStack]:
    """The cold path of one broker (see ``support.ColdStack``) over ``object_store``."""
    s = await ColdStack(etcd_kv, keys, object_store, tmp_path / "wal").open()
    yield s
    await s.close()
