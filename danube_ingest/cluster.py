"""A small danube-ingest cluster in podman pods: the manifests ``podman kube play`` runs.

``danube-ingest cluster kube`` prints them; ``deploy/podman/cluster.yaml`` is its default output
(etcd, Kafka, two brokers, the Dagster UI, all from the project's image). Every pod uses the
host's network and listens on ``127.0.0.1`` only, so nothing is exposed beyond the machine (the
brokers serve plain gRPC on loopback, as ``danube-ingest dev`` does):

=====================  ==========================================  ==============================
pod                    what runs in it                             ports (defaults)
=====================  ==========================================  ==============================
``{name}-etcd``        ``danube-ingest etcd`` (the wheel's etcd)   2379 (clients), 2380 (peers)
``{name}-kafka``       ``danube-ingest kafka`` (KRaft, one node)   9092, 9093 (controller)
``{name}-broker-N``    ``danube-ingest broker``, WAL on Kafka      6650 + N - 1; metrics + 3000
``{name}-dagster``     ``danube-ingest dagster`` (UI + daemon)     3000
=====================  ==========================================  ==============================

The brokers share one object store, the volume ``{name}-objects`` mounted at ``/objects`` in
each broker and in the Dagster pod (the fs backend). Each broker's WAL lives in Kafka, so when a
broker dies the others take its topics over from Kafka and the objects without it (etcd lease
expiry, ``etcd.lease_ttl_seconds`` later). Each pod keeps its own state in a volume
``{name}-<pod>-data`` at ``/data``; the configuration is a ConfigMap per pod, mounted at
``/etc/danube-ingest``.

A single Kafka node holds the WAL topics with one replica (``replication_factor: 1``), so this
recipe survives the loss of a broker, not of the Kafka node: a production cluster points
``storage.wal.kafka.bootstrap_servers`` at a Kafka cluster of three or more nodes and keeps the
default replication (3, ``min.insync.replicas`` 2).

``broker_manifest`` gives one more broker's pod (``--broker N``): scaling out is playing it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import yaml

__all__ = ["DEFAULT_IMAGE", "ClusterSpec", "broker_manifest", "manifest"]

#: The tag ``make image`` points at the newest build.
DEFAULT_IMAGE = "localhost/danube-ingest:latest"

_CONFIG_DIR = "/etc/danube-ingest"
_CONFIG = f"{_CONFIG_DIR}/danube.yml"


@dataclass(frozen=True)
class ClusterSpec:
    """What ``manifest`` lays out; every port on ``127.0.0.1`` of the host."""

    image: str = DEFAULT_IMAGE
    #: Prefix of every pod and volume name (two clusters on one host need two names).
    name: str = "danube"
    brokers: int = 2
    etcd_port: int = 2379
    kafka_port: int = 9092
    #: broker-N listens on ``broker_port + N - 1``, its metrics on that + 3000.
    broker_port: int = 6650
    dagster_port: int = 3000
    #: ``kafka``: the brokers' WAL is in the Kafka pod; ``local``: on each broker's volume (a
    #: dead broker's unuploaded tail then waits for it to come back, see ``brokers list``).
    wal: str = "kafka"

    def __post_init__(self) -> None:
        if self.brokers < 1:
            raise ValueError(f"a cluster needs at least one broker, not {self.brokers}")
        if self.wal not in ("kafka", "local"):
            raise ValueError(f"wal must be kafka or local, not {self.wal!r}")
        ports = [self.etcd_port, self.etcd_port + 1, self.dagster_port]
        if self.wal == "kafka":
            ports += [self.kafka_port, self.kafka_port + 1]
        for port in [*ports, self.broker_port, self.metrics_port(self.brokers)]:
            if not 1 <= port <= 65535:
                raise ValueError(f"port {port} is out of range")

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    def broker_id(self, n: int) -> str:
        return f"broker-{n}"

    def listen(self, n: int) -> str:
        return f"127.0.0.1:{self.broker_port + n - 1}"

    def metrics_port(self, n: int) -> int:
        return self.broker_port + n - 1 + 3000


def _config(spec: ClusterSpec, broker: int | None) -> dict[str, Any]:
    """The danube-ingest YAML of one pod: a broker's (``broker`` = N) or the Dagster code
    location's (``None``: the same storage, no broker identity)."""
    wal: dict[str, Any] = {"backend": spec.wal}
    if spec.wal == "kafka":
        wal["kafka"] = {
            "bootstrap_servers": f"127.0.0.1:{spec.kafka_port}",
            "replication_factor": 1,
        }
    config: dict[str, Any] = {
        "broker": {"data_dir": "/data"},
        "storage": {"wal": wal, "cloud": {"backend": "fs", "root": "/objects"}},
        "etcd": {"endpoints": [spec.etcd_url]},
    }
    if broker is not None:
        config["broker"].update(broker_id=spec.broker_id(broker), listen=spec.listen(broker))
        config["metrics"] = {"listen": f"127.0.0.1:{spec.metrics_port(broker)}"}
    return config


def _config_map(name: str, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"danube.yml": yaml.safe_dump(config, sort_keys=False)},
    }


def _pod(
    spec: ClusterSpec,
    pod: str,
    args: list[str],
    *,
    config: str | None = None,
    objects: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    name = f"{spec.name}-{pod}"
    mounts: list[dict[str, Any]] = [{"name": "data", "mountPath": "/data"}]
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": f"{name}-data"}}
    ]
    if config is not None:
        mounts.append({"name": "config", "mountPath": _CONFIG_DIR, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": config}})
    if objects:
        mounts.append({"name": "objects", "mountPath": "/objects"})
        volumes.append(
            {"name": "objects", "persistentVolumeClaim": {"claimName": f"{spec.name}-objects"}}
        )
    container: dict[str, Any] = {
        "name": pod.split("-")[0],
        "image": spec.image,
        "imagePullPolicy": "Never",
        "args": args,
    }
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    container["volumeMounts"] = mounts
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": spec.name, "role": pod.split("-")[0]}},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "OnFailure",
            "containers": [container],
            "volumes": volumes,
        },
    }


def _broker_docs(spec: ClusterSpec, n: int) -> list[dict[str, Any]]:
    config = f"{spec.name}-broker-{n}-config"
    return [
        _config_map(config, _config(spec, n)),
        _pod(spec, f"broker-{n}", ["broker", "--config", _CONFIG], config=config, objects=True),
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMaps' files) as literal blocks, readable as written."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def _dump(docs: list[dict[str, Any]], title: str) -> str:
    body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    note = "# Generated by `danube-ingest cluster kube`; see docs/containers.md."
    return f"# {title}\n{note}\n{body}"


def manifest(spec: ClusterSpec = ClusterSpec()) -> str:
    """The whole cluster: etcd, Kafka (with ``wal: kafka``), ``spec.brokers`` brokers and the
    Dagster UI, as one multi-document YAML for ``podman kube play``."""
    docs: list[dict[str, Any]] = [
        _pod(spec, "etcd", ["etcd", "--data-dir", "/data/etcd", "--port", str(spec.etcd_port)])
    ]
    if spec.wal == "kafka":
        docs.append(
            _pod(
                spec,
                "kafka",
                ["kafka", "--data-dir", "/data/kafka", "--port", str(spec.kafka_port)],
            )
        )
    for n in range(1, spec.brokers + 1):
        docs += _broker_docs(spec, n)
    dagster_config = f"{spec.name}-dagster-config"
    docs += [
        _config_map(dagster_config, _config(spec, None)),
        _pod(
            spec,
            "dagster",
            ["dagster", "--config", _CONFIG, "--port", str(spec.dagster_port)],
            config=dagster_config,
            objects=True,
        ),
    ]
    title = (
        f"danube-ingest cluster {spec.name!r}: etcd, "
        + ("Kafka, " if spec.wal == "kafka" else "")
        + f"{spec.brokers} broker(s), the Dagster UI"
    )
    return _dump(docs, title)


def broker_manifest(spec: ClusterSpec, n: int) -> str:
    """Broker N alone (its ConfigMap and pod), to scale a running cluster out."""
    if n < 1:
        raise ValueError(f"broker numbers start at 1, not {n}")
    spec = replace(spec, brokers=max(spec.brokers, n))
    return _dump(_broker_docs(spec, n), f"danube-ingest cluster {spec.name!r}: broker-{n}")
