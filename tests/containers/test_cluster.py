"""The local cluster recipe, as docs/containers.md gives it: its shell blocks run as written, in
order (``make image``, ``podman kube play deploy/podman/cluster.yaml`` with the settings of
``deploy/podman/``, the CLI through ``podman exec``, the kill, the added broker, the stop).
Between them danube-client produces through broker 1; after broker 1's pod is killed, broker 2
takes the topics over from Kafka (no operator, the dead broker not needed) and every
acknowledged message is consumed through it, by the CLI and by danube-client; broker 3 joins;
the Dagster UI has the code location loaded against the cluster's etcd. The recipe's default
ports (2379, 9092, 6650-6652, 9650-9652, 3000) must be free."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.cluster import ClusterSpec
from danube_ingest.metadata.server import port_in_use
from tests.broker.support import Clients, payloads
from tests.cli.cli_support import graphql

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PODMAN_ENV = {
    "CONTAINERS_CONF": str(ROOT / "deploy/podman/containers.conf"),
    "CONTAINERS_STORAGE_CONF": str(ROOT / "deploy/podman/storage.conf"),
}


def _podman(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """``podman ARGS`` as docs/containers.md runs it (the settings of ``deploy/podman``)."""
    run = subprocess.run(
        ["podman", *args],
        input=stdin,
        env={**os.environ, **PODMAN_ENV},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0 or not check, f"podman {args}: {run.stdout}{run.stderr}"
    return run.stdout


def _cli(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _wait(what: str, probe: Callable[[], Any], timeout: float, logs: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f}s; logs:\n{logs()}")
        time.sleep(0.5)


def _ready(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _owner(etcd: tuple[str, ...], topic: str) -> str | None:
    """The broker owning ``topic`` (``danube-ingest topics``: "broker-N (epoch E)")."""
    for line in _cli("topics", *etcd).splitlines():
        if line.split()[:1] == [topic]:
            owner = line.split()[2]
            return None if owner == "-" else owner
    return None


_LOCATION = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus } } } }"""
_RESOURCES = """{ repositoriesOrError { ... on RepositoryConnection { nodes {
  allTopLevelResourceDetails { name configuredValues { key value } } } } } }"""


def _blocks() -> list[str]:
    """The ```bash blocks of docs/containers.md's "A local cluster" section, in order."""
    text = (ROOT / "docs/containers.md").read_text()
    section = text.split("## A local cluster", 1)[1].split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in section.split("```bash\n")[1:]]


def _shell(script: str) -> str:
    """One block as pasted into bash (``set -e``: a failing command fails the test)."""
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, f"{script}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    return run.stdout + run.stderr  # (the CLI's progress lines are on stderr)


@pytest.fixture
def cluster(image: str) -> Iterator[ClusterSpec]:
    spec = ClusterSpec()
    ports = [2379, 2380, 9092, 9093, 3000]
    ports += [p for n in (1, 2, 3) for p in (spec.broker_port + n - 1, spec.metrics_port(n))]
    busy = [port for port in ports if port_in_use("127.0.0.1", port)]
    assert not busy, f"the recipe's ports {busy} are in use (danube-ingest dev running?)"
    pods = [p for p in _podman("pod", "ls", "--format", "{{.Name}}").split() if "danube-" in p]
    assert not pods, f"a cluster is running already: {pods}; podman kube down it first"
    try:
        yield spec
    finally:
        for pod in _podman("pod", "ls", "--format", "{{.Name}}", check=False).split():
            if pod.startswith(f"{spec.name}-"):
                _podman("pod", "rm", "--force", pod, check=False)
        for volume in _podman("volume", "ls", "--format", "{{.Name}}", check=False).split():
            if volume.startswith(f"{spec.name}-"):
                _podman("volume", "rm", "--force", volume, check=False)


async def test_the_documented_cluster_takes_over_a_killed_broker_from_kafka(
    cluster: ClusterSpec,
) -> None:
    spec = cluster
    env = "".join(f"export {k}={v}\n" for k, v in PODMAN_ENV.items())
    start, publish, kill, add, stop = _blocks()

    def logs() -> str:
        out = []
        for pod in ("etcd", "kafka", "broker-1", "broker-2", "broker-3", "dagster"):
            container = f"{spec.name}-{pod}-{pod.split('-')[0]}"
            text = _podman("logs", "--tail", "15", container, check=False)
            out.append(f"--- {container}\n{text}")
        return "\n".join(out)

    started = _shell(start)
    for pod in ("etcd", "kafka", "broker-1", "broker-2", "dagster"):
        assert f"danube-{pod} " in started, started  # podman pod ps: all five running
    published = _shell(env + publish)
    assert "/default/orders  reliable  broker-1 (epoch 1)" in published, published
    assert "brokers (2 live)" in published, published

    # danube-client, as applications use it, through broker 1 (which then owns the topic).
    etcd = ("--etcd", spec.etcd_url)
    topic = "/default/cluster"
    sent = [f"m{i}".encode() for i in range(40)]
    async with Clients(f"http://{spec.listen(1)}") as clients:
        producer = await clients.producer(topic)
        consumer = await clients.consumer(topic, "ops", "c1")
        for payload in sent:
            await producer.send(payload)  # acknowledged: committed in Kafka
        received = await consumer.take(10)
        assert payloads(received) == sent[:10]
        await consumer.ack_all(received)
    assert _owner(etcd, topic) == "broker-1"

    # The docs' kill: broker 2 takes /default/orders over from Kafka; the CLI consumes all.
    killed = _shell(env + kill)
    assert "received 1000/1000 messages" in killed, killed
    assert "recovered" in killed and "broker-2 (epoch 2)" in killed, killed
    async with Clients(f"http://{spec.listen(2)}") as clients:
        consumer = await clients.consumer(topic, "ops", "c2")
        received = await consumer.take(len(sent) - 10)
        # At least once: whatever was not acknowledged comes again, nothing is missing.
        assert set(payloads(received)) >= set(sent[10:]), payloads(received)
        await consumer.ack_all(received)
    assert _owner(etcd, topic) == "broker-2"

    # Scale out: broker 3 from its own manifest joins the cluster.
    _shell(env + add)
    _wait("broker-3 ready", lambda: _ready(spec.metrics_port(3)), 180, logs)
    listed = _cli("brokers", "list", *etcd)
    assert "broker-3" in listed and "broker-2" in listed, listed

    # The Dagster UI: the code location loaded, against the cluster's etcd and object store.
    def loaded() -> bool:
        data = graphql(f"http://127.0.0.1:{spec.dagster_port}", _LOCATION)
        entries = data and data["workspaceOrError"]["locationEntries"]
        return bool(entries and entries[0]["loadStatus"] == "LOADED")

    _wait("the Dagster code location", loaded, 240, logs)
    data = graphql(f"http://127.0.0.1:{spec.dagster_port}", _RESOURCES)
    assert data is not None
    (repository,) = data["repositoriesOrError"]["nodes"]
    values = {
        (r["name"], v["key"]): v["value"]
        for r in repository["allTopLevelResourceDetails"]
        for v in r["configuredValues"]
    }
    assert values[("etcd", "endpoints")] == json.dumps(spec.etcd_url), values
    assert values[("objects", "config_path")] == json.dumps("/etc/danube-ingest/danube.yml")

    # The docs' stop: no pod and no volume of the cluster is left.
    _shell(env + stop)
    assert not [p for p in _podman("pod", "ls", "--format", "{{.Name}}").split() if "danube-" in p]
    volumes = _podman("volume", "ls", "--format", "{{.Name}}").split()
    assert not [v for v in volumes if v.startswith("danube-")], volumes
