"""Child process of the uploader crash tests: builds a broker's cold path on a WAL directory and
an fs object store, appends 500 messages to one topic, then dies (exit code 9, no cleanup) at
the step it is told:

* ``after_put``: every sealed segment's object is stored (the uploader's own build + PUT
  step), nothing is committed to the manifest.
* ``after_commit``: the uploader ran to completion (objects stored, manifest committed, segments
  marked uploaded in memory), but the marks never reached a snapshot and nothing was cleaned.

Usage: crash_child.py MODE ETCD_ENDPOINT PREFIX WAL_DIR OBJECTS_ROOT
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import build_segment_object, segment_key

sys.path.insert(0, str(Path(__file__).parents[2]))

from tests.objects.support import ColdStack

TOPIC = "/default/cold"


async def main(mode: str, etcd: str, prefix: str, wal: str, root: str) -> None:
    kv = await EtcdKV.connect([etcd], timeout=5.0)
    objects = ObjectStore("fs", options={"root": root})
    stack = await ColdStack(kv, Keys(prefix), objects, Path(wal), lease_ttl=2).open()
    await stack.acquire(TOPIC)
    payloads = [f"{TOPIC}:{i}:".encode().ljust(300, b".") for i in range(500)]
    await stack.append(TOPIC, payloads)
    await stack.seal()
    region = stack.store.regions[0]
    if mode == "after_put":
        for seq in sorted(region.sealed):
            key = segment_key(stack.broker_id, region.region, seq)
            data = await region.read(seq, 0, region.segment_sizes[seq])
            obj = build_segment_object(data, key=key, codec="zstd")
            if obj.footer.topics:
                assert obj.data is not None
                assert await objects.put_if_absent(key, obj.data)
    elif mode == "after_commit":
        stack.uploader.start()
        await stack.seal_and_upload()
    else:
        raise SystemExit(f"unknown mode {mode}")
    os._exit(9)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
