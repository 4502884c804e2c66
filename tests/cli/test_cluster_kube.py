"""``danube-ingest cluster kube``: the pods of the local cluster recipe. The file the docs play
(``deploy/podman/cluster.yaml``) is the command's output, every broker's ConfigMap is a valid
broker configuration, and bad arguments are refused. (Played in podman by
``tests/containers/test_cluster.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from danube_ingest.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _kube(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", "cluster", "kube", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _docs(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_the_recipe_file_is_the_commands_output() -> None:
    run = _kube()
    assert run.returncode == 0, run.stderr
    recipe = ROOT / "deploy/podman/cluster.yaml"
    assert recipe.read_text() == run.stdout, f"stale: danube-ingest cluster kube > {recipe}"
    pods = {d["metadata"]["name"]: d for d in _docs(run.stdout) if d["kind"] == "Pod"}
    assert set(pods) == {
        "danube-etcd", "danube-kafka", "danube-broker-1", "danube-broker-2", "danube-dagster"
    }  # fmt: skip
    for pod in pods.values():
        assert pod["spec"]["hostNetwork"] is True
        (container,) = pod["spec"]["containers"]
        assert container["image"] == "localhost/danube-ingest:latest"
        assert container["imagePullPolicy"] == "Never"  # built here, no registry
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/data"] == "data"


def test_each_broker_gets_a_valid_configuration_of_its_own(tmp_path: Path) -> None:
    run = _kube("--brokers", "3", "--name", "east", "--broker-port", "7000")
    assert run.returncode == 0, run.stderr
    maps = {d["metadata"]["name"]: d["data"]["danube.yml"] for d in _docs(run.stdout)
            if d["kind"] == "ConfigMap"}  # fmt: skip
    assert set(maps) == {f"east-broker-{n}-config" for n in (1, 2, 3)} | {"east-dagster-config"}
    for n in (1, 2, 3):
        path = tmp_path / f"b{n}.yml"
        path.write_text(maps[f"east-broker-{n}-config"])
        config = load_config(path)
        assert config.broker.broker_id == f"broker-{n}"
        assert config.broker.listen == f"127.0.0.1:{7000 + n - 1}"
        assert config.metrics.listen == f"127.0.0.1:{10000 + n - 1}"
        assert config.storage.wal.backend == "kafka"
        assert config.storage.wal.kafka.bootstrap_servers == "127.0.0.1:9092"
        assert config.storage.cloud.root == "/objects"  # the shared volume
    # One more broker alone: its ConfigMap and pod, the next port.
    added = _docs(_kube("--name", "east", "--broker-port", "7000", "--broker", "4").stdout)
    assert [d["kind"] for d in added] == ["ConfigMap", "Pod"]
    assert "listen: 127.0.0.1:7003" in added[0]["data"]["danube.yml"]
    assert added[1]["metadata"]["name"] == "east-broker-4"


def test_bad_arguments_are_refused() -> None:
    for args, message in (
        (("--brokers", "0"), "at least one broker"),
        (("--broker-port", "65000"), "out of range"),
        (("--broker", "0"), "start at 1"),
    ):
        run = _kube(*args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
        assert run.stdout == ""
